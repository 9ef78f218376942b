"""Lowerings of the prims that Dynamo writes into graphs, which exist once Inductor's are imported.

Dynamo rewrites `addcmul_` and `addcdiv_` with a `value`, and `add_` with a tensor `alpha`, into
Inductor's `prims.fma(a, b, c) = a * b + c` (as CUDA's kernels compute them), so a compiled
optimizer step holds it (AdamW's and Adam's single-tensor `exp_avg_sq.mul_(beta2).addcmul_(grad,
grad, value=1 - beta2)`). The op is made when `torch._inductor.inductor_prims` is imported,
which `torch.compile(backend="tpu")` does (`torchtpu.exec.compile`), not `import torchtpu`: it
imports Inductor (~1 s). Whether `a * b + c` is one fused multiply-add is XLA's choice on each
platform, as for the eager `addcmul` lowering; PyTorch's CPU kernels round after the product.
"""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # noqa: F401  (makes torch.ops.prims.fma)

from torchtpu.ops.promotion import pointwise

prims = torch.ops.prims


@pointwise(prims.fma.default, operands=("a", "b", "c"))
def fma(ctx, a, b, c):
    return a * b + c
