"""A Helion kernel (Pallas backend) as a torch op on `tpu`: `relu(x + bias)` over row tiles.

Needs the optional extra `pip install .[helion]`. Helion writes the kernel over torch tensors
and compiles it to a `pallas_call`; `torchtpu.kernels.jax_kernel` registers it like a JAX
function: it runs in strict, defer and compiled modes, interpreted on the CPU stand-in (Mosaic
on a TPU: untested, no TPU here). The backward is a custom VJP in JAX.

    python -m examples.kernels.helion_bias_relu
"""

from __future__ import annotations

import helion
import helion.language as hl
import jax.numpy as jnp
import torch

import torchtpu


def _bias_relu_backward(primals, cotangents):
    x, bias = primals
    masked = jnp.where(x + bias > 0, cotangents[0], jnp.zeros_like(cotangents[0]))
    return masked, masked.sum(axis=0)


@torchtpu.kernels.jax_kernel("examples::helion_bias_relu", backward=_bias_relu_backward)
@helion.kernel(backend="pallas", config=helion.Config(block_sizes=[8, 128]))
def bias_relu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`relu(x + bias)` for `x [M, N]` and `bias [N]`, in `[8, 128]` tiles."""
    out = torch.empty_like(x)
    for tile_m, tile_n in hl.tile(x.size()):
        out[tile_m, tile_n] = torch.relu(x[tile_m, tile_n] + bias[tile_n])
    return out


def main() -> None:
    x, bias = torch.randn(16, 256), torch.randn(256)
    got = bias_relu(x.to("tpu"), bias.to("tpu")).cpu()
    print("max |tpu (Helion) - cpu|:", (got - torch.relu(x + bias)).abs().max().item())


if __name__ == "__main__":
    main()
