"""The inference fast path of `nn.MultiheadAttention` and `nn.TransformerEncoder(Layer)` on tpu.

In eval mode without gradients PyTorch sends these modules, on CPU, CUDA and the PrivateUse1
device alike, to fused kernels of their own: `_native_multi_head_attention`,
`_transformer_encoder_layer_fwd` and, for a padding mask, a nested tensor built from the padded
input. Those kernels exist for CPU and CUDA only, so on tpu they took the CPU fallback, and the
encoder with a padding mask failed outright (nested tensors have no tpu form). Here each fused
op is the composition of the modules' own steps -- projections, scaled dot products, softmax,
layer norms, the feed-forward block -- in ATen ops that have lowerings, so they run (and fuse)
on the device; and the encoder's question whether a padding mask can become a nested tensor
(`_nested_tensor_from_mask_left_aligned`) is answered no, which keeps its input padded. Results
equal the modules' training-mode path; at padded positions the encoder's output holds the
layer's values there, as PyTorch's padded path gives (its nested path writes zeros).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch._ops import OpOverload

aten = torch.ops.aten

_KEY_PADDING, _MERGED = 1, 2  # `MultiheadAttention.merge_masks`' mask types; 0 is an [L, S] attention mask


def _masked(scores: torch.Tensor, mask: torch.Tensor, mask_type: int | None) -> torch.Tensor:
    """`scores` `[batch, heads, L, S]` under `mask`: a boolean mask blocks where it is True, any
    other is added (the encoder hands its layers masks made additive, -inf where blocked)."""
    batch, _, length, source_length = scores.shape
    if mask_type == _KEY_PADDING:
        mask = mask.view(batch, 1, 1, source_length)
    elif mask_type == _MERGED:
        mask = mask.view(batch, -1, length, source_length)
    else:
        mask = mask.view(1, 1, length, source_length)
    return scores.masked_fill(mask, float("-inf")) if mask.dtype == torch.bool else scores + mask


def native_multi_head_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim: int, num_head: int,
    qkv_weight: torch.Tensor, qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
    mask: torch.Tensor | None = None, need_weights: bool = True, average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batch-first multi-head attention with packed input projections, under `mask` (`_masked`;
    a fully blocked row is NaN, as PyTorch's). The weights are averaged over
    heads unless `average_attn_weights` is False, and None (PyTorch's undefined tensor) without
    `need_weights`."""
    batch, length, _ = query.shape
    head_dim = embed_dim // num_head
    weights = qkv_weight.chunk(3)
    biases = qkv_bias.chunk(3)

    def heads(x: torch.Tensor, i: int) -> torch.Tensor:
        return F.linear(x, weights[i], biases[i]).view(batch, -1, num_head, head_dim).transpose(1, 2)

    q, k, v = heads(query, 0), heads(key, 1), heads(value, 2)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_dim)
    if mask is not None:
        scores = _masked(scores, mask, mask_type)
    attention = scores.softmax(-1)
    output = F.linear((attention @ v).transpose(1, 2).reshape(batch, length, embed_dim), proj_weight, proj_bias)
    if not need_weights:
        return output, None
    return output, attention.mean(1) if average_attn_weights else attention


def transformer_encoder_layer_fwd(
    src: torch.Tensor, embed_dim: int, num_heads: int, qkv_weight: torch.Tensor, qkv_bias: torch.Tensor,
    proj_weight: torch.Tensor, proj_bias: torch.Tensor, use_gelu: bool, norm_first: bool, eps: float,
    norm_weight_1: torch.Tensor, norm_bias_1: torch.Tensor, norm_weight_2: torch.Tensor, norm_bias_2: torch.Tensor,
    ffn_weight_1: torch.Tensor, ffn_bias_1: torch.Tensor, ffn_weight_2: torch.Tensor, ffn_bias_2: torch.Tensor,
    mask: torch.Tensor | None = None, mask_type: int | None = None,
) -> torch.Tensor:
    """One `TransformerEncoderLayer` in eval mode: self-attention and the feed-forward block, each
    with its residual, the layer norms before (`norm_first`) or after them."""

    def attend(x: torch.Tensor) -> torch.Tensor:
        return native_multi_head_attention(x, x, x, embed_dim, num_heads, qkv_weight, qkv_bias, proj_weight,
                                           proj_bias, mask, False, True, mask_type)[0]

    def feed_forward(x: torch.Tensor) -> torch.Tensor:
        hidden = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(hidden) if use_gelu else F.relu(hidden), ffn_weight_2, ffn_bias_2)

    def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (embed_dim,), weight, bias, eps)

    x = src
    if norm_first:
        x = x + attend(norm(x, norm_weight_1, norm_bias_1))
        return x + feed_forward(norm(x, norm_weight_2, norm_bias_2))
    x = norm(x + attend(x), norm_weight_1, norm_bias_1)
    return norm(x + feed_forward(x), norm_weight_2, norm_bias_2)


def nested_tensor_from_mask_left_aligned(t: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether the encoder may turn its padded input into a nested tensor: never on tpu (see the
    module docstring). Reads nothing from the device."""
    return False


FASTPATH: dict[OpOverload, Callable] = {
    aten._native_multi_head_attention.default: native_multi_head_attention,
    aten._transformer_encoder_layer_fwd.default: transformer_encoder_layer_fwd,
    aten._nested_tensor_from_mask_left_aligned.default: nested_tensor_from_mask_left_aligned,
}
"""The fast path's ops, as the compositions eager mode runs in their place (`decomps.get`)."""
