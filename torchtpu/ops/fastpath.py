"""The inference fast path of `nn.MultiheadAttention` and `nn.TransformerEncoder(Layer)` on tpu.

In eval mode without gradients PyTorch sends these modules, on CPU, CUDA and the PrivateUse1
device alike, to fused kernels of their own: `_native_multi_head_attention`,
`_transformer_encoder_layer_fwd` and, for a padding mask, a nested tensor built from the padded
input. Those kernels exist for CPU and CUDA only, so on tpu they took the CPU fallback, and the
encoder with a padding mask failed outright (nested tensors have no tpu form). Here each fused
op is what the modules run outside the fast path -- attention is PyTorch's own
`F.multi_head_attention_forward`, the encoder layer its layer norms, attention and feed-forward
block -- in ATen ops that have lowerings, so they run (and fuse) on the device; and the
encoder's question whether a padding mask can become a nested tensor
(`_nested_tensor_from_mask_left_aligned`) is answered no, which keeps its input padded. Results
equal the modules' training-mode path; at padded positions the encoder's output holds the
layer's values there, as PyTorch's padded path gives (its nested path writes zeros).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch._ops import OpOverload

aten = torch.ops.aten

_KEY_PADDING, _MERGED = 1, 2  # `MultiheadAttention.merge_masks`' mask types; 0 is an [L, S] attention mask


def native_multi_head_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim: int, num_head: int,
    qkv_weight: torch.Tensor, qkv_bias: torch.Tensor, proj_weight: torch.Tensor, proj_bias: torch.Tensor,
    mask: torch.Tensor | None = None, need_weights: bool = True, average_attn_weights: bool = True,
    mask_type: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batch-first multi-head attention with packed input projections: PyTorch's own
    `F.multi_head_attention_forward` (the module's path outside the fast path), given the mask
    as the kind `mask_type` names. The weights are None (PyTorch's undefined tensor) without
    `need_weights`."""
    batch, length, _ = query.shape
    key_padding_mask = attn_mask = None
    if mask is not None and mask_type == _KEY_PADDING:
        key_padding_mask = mask.view(batch, key.shape[1])
    elif mask is not None and mask_type == _MERGED:
        # [batch, 1 or heads, L, S] -> the [batch * heads, L, S] that F's 3-d masks are.
        attn_mask = mask.view(batch, -1, length, key.shape[1]).expand(batch, num_head, -1, -1).reshape(
            batch * num_head, length, key.shape[1])
    elif mask is not None:
        attn_mask = mask.view(length, key.shape[1])
    output, weights = F.multi_head_attention_forward(
        query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), embed_dim, num_head,
        qkv_weight, qkv_bias, None, None, False, 0.0, proj_weight, proj_bias, training=False,
        key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
        average_attn_weights=average_attn_weights)
    return output.transpose(0, 1), weights


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
