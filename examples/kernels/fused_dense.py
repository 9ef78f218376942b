"""A fused dense layer -- matmul + bias + ReLU in one Pallas kernel -- as a torch op on `tpu`.

    python -m examples.kernels.fused_dense [--steps N] [--mode strict|defer|compiled]

The forward is one `pallas_call`: each grid step computes an `[bm, bn]` tile of
`relu(x @ w + b)` from a row panel of `x` and a column panel of `w`, so the pre-activation never
leaves VMEM. The backward, given as a custom VJP (JAX cannot differentiate a `pallas_call`),
masks the cotangent by the output's sign and computes the three gradients with XLA matmuls.
Both run in Pallas's interpreter on the CPU stand-in and compile to Mosaic on a TPU (untested:
no TPU here). The script trains a two-layer regression model built on the op and prints its
loss next to the same model on CPU with `torch.nn.Linear` + ReLU.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import torch
from jax.experimental import pallas as pl
from torch import nn

import torchtpu

_HIGHEST = jax.lax.Precision.HIGHEST


def _tile(size: int, preferred: int) -> int:
    """The tile along a dimension of `size`: `preferred` if it divides it, else the whole dim."""
    return preferred if size % preferred == 0 else size


def _dense_relu_kernel(x_ref, w_ref, b_ref, o_ref):
    acc = jnp.dot(x_ref[...], w_ref[...], precision=_HIGHEST, preferred_element_type=jnp.float32)
    o_ref[...] = jnp.maximum(acc + b_ref[...], 0.0).astype(o_ref.dtype)


def _dense_relu_backward(primals, cotangents):
    x, w, b = primals
    (grad,) = cotangents
    out = fused_dense_relu.fn(x, w, b)
    masked = jnp.where(out > 0, grad, jnp.zeros_like(grad))
    return (
        jnp.dot(masked, w.T, precision=_HIGHEST),
        jnp.dot(x.T, masked, precision=_HIGHEST),
        masked.sum(axis=0),
    )


@torchtpu.kernels.jax_kernel("examples::fused_dense_relu", backward=_dense_relu_backward)
def fused_dense_relu(x, w, b):
    """`relu(x @ w + b)` for `x [M, K]`, `w [K, N]`, `b [N]`, tiled `[128, 128]` over the output
    where the sizes allow (whole dims otherwise)."""
    (m, k), n = x.shape, w.shape[1]
    if w.shape[0] != k or b.shape != (n,):
        raise ValueError(f"fused_dense_relu: x {x.shape}, w {w.shape} and b {b.shape} do not chain")
    bm, bn = _tile(m, 128), _tile(n, 128)
    return pl.pallas_call(
        _dense_relu_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(m // bm, n // bn),
        in_specs=[
            pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
            pl.BlockSpec((k, bn), lambda i, j: (0, j)),
            pl.BlockSpec((1, bn), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        name="fused_dense_relu",
    )(x, w, b.reshape(1, n))


class FusedDenseReLU(nn.Module):
    """`relu(linear(x))` through the fused kernel; parameters laid out `[in, out]` for it."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        reference = nn.Linear(in_features, out_features)
        self.weight = nn.Parameter(reference.weight.detach().T.contiguous())
        self.bias = nn.Parameter(reference.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_dense_relu(x, self.weight, self.bias)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mode", choices=["strict", "defer", "compiled"], default="defer")
    args = parser.parse_args()

    torch.manual_seed(0)
    fused = nn.Sequential(FusedDenseReLU(16, 128), nn.Linear(128, 1))
    reference = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 1))
    with torch.no_grad():
        reference[0].weight.copy_(fused[0].weight.T)
        reference[0].bias.copy_(fused[0].bias)
        reference[2].load_state_dict(fused[1].state_dict())
    fused.to("tpu")
    forward = torch.compile(fused, backend="tpu") if args.mode == "compiled" else fused
    torchtpu.set_eager_mode("strict" if args.mode == "compiled" else args.mode)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, reference)]
    for step in range(args.steps):
        x = torch.randn(64, 16)
        y = x.sin().sum(dim=1, keepdim=True)
        losses = []
        for run, optimizer, device in ((forward, optimizers[0], "tpu"), (reference, optimizers[1], "cpu")):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(run(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss tpu (fused kernel) {losses[0]:.6f}  cpu (nn.Linear + ReLU) {losses[1]:.6f}")


if __name__ == "__main__":
    main()
