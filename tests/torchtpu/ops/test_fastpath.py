"""The attention modules' inference fast path on tpu against PyTorch's CPU kernels: the fused ops
called directly (every mask type, with and without weights) and `nn.TransformerEncoder` /
`nn.MultiheadAttention` in eval mode, which route to them -- with a padding mask too, which on
CPU becomes a nested tensor. Nothing may take the CPU fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cpu_reference import strict_ops  # noqa: F401  (the autouse fixture)

B, L, E, H = 2, 6, 32, 4
TOLERANCE = dict(rtol=1e-5, atol=2e-6)


@pytest.fixture(autouse=True)
def highest():
    with torch.tpu.precision("highest"), torch.no_grad():
        yield


def _on(device, *tensors):
    return [None if t is None else t.to(device) for t in tensors]


def _padding() -> torch.Tensor:
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[1, 4:] = True
    return mask


MASKS = {
    "none": (None, None),
    "attention": (torch.ones(L, L, dtype=torch.bool).triu(1), 0),
    "key_padding": (_padding(), 1),
    "merged": (torch.ones(L, L, dtype=torch.bool).triu(1).expand(B, H, L, L) | _padding().view(B, 1, 1, L), 2),
    "additive": (torch.zeros(L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf")), 0),
}


@pytest.mark.parametrize("mask", sorted(MASKS))
@pytest.mark.parametrize("need_weights, average", [(False, True), (True, True), (True, False)])
def test_native_multi_head_attention(mask, need_weights, average):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, L, E, generator=g)
    weights = [torch.randn(3 * E, E, generator=g) / 6, torch.randn(3 * E, generator=g),
               torch.randn(E, E, generator=g) / 6, torch.randn(E, generator=g)]
    mask_value, mask_type = MASKS[mask]

    def run(device):
        q, qkv_w, qkv_b, proj_w, proj_b, m = _on(device, x, *weights, mask_value)
        return torch._native_multi_head_attention(q, q, q, E, H, qkv_w, qkv_b, proj_w, proj_b, m, need_weights,
                                                   average, mask_type)

    (out, attention), (expected, expected_attention) = run("tpu"), run("cpu")
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE)
    if need_weights:
        torch.testing.assert_close(attention.cpu(), expected_attention, **TOLERANCE)
    else:
        assert attention is None and expected_attention is None


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_transformer_encoder_in_eval_mode(norm_first, activation, nested, masking):
    """At padded positions PyTorch's CPU nested path writes zeros and the padded path (tpu's)
    the layer's values there: only the other positions are compared."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 2 * E, batch_first=True, norm_first=norm_first, activation=activation)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested).eval()
    x = torch.randn(B, L, E)
    padding = _padding() if masking == "padding" else None
    causal = nn.Transformer.generate_square_subsequent_mask(L, dtype=torch.bool) if masking == "causal" else None

    def run(device):
        src, key_padding, mask = _on(device, x, padding, causal)
        return encoder.to(device)(src, mask=mask, src_key_padding_mask=key_padding, is_causal=causal is not None).cpu()

    expected = run("cpu")
    actual = run("tpu")
    kept = ~padding if padding is not None else torch.ones(B, L, dtype=torch.bool)
    torch.testing.assert_close(actual[kept], expected[kept], **TOLERANCE)


def test_multi_head_attention_module_in_eval_mode():
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(E, H, batch_first=True).eval()
    x, padding = torch.randn(B, L, E), _padding()
    expected = attention(x, x, x, key_padding_mask=padding, need_weights=False)[0]
    xt = x.to("tpu")
    actual = attention.to("tpu")(xt, xt, xt, key_padding_mask=padding.to("tpu"), need_weights=False)[0]
    torch.testing.assert_close(actual.cpu(), expected, **TOLERANCE)
