"""Custom kernels: JAX functions (Pallas kernels included) and Helion kernels as torch ops on `tpu`.

    @torchtpu.kernels.jax_kernel("mylib::scaled_add")
    def scaled_add(x, y, *, alpha: float = 1.0):
        return x + alpha * y

    out = scaled_add(a, b, alpha=2.0)          # a, b: tpu tensors -> a tpu tensor

The decorator defines a real torch op (`torch.ops.mylib.scaled_add`). Positional parameters are
tensors (they arrive in the function as `jax.Array`s, without a copy); keyword-only parameters
are static Python values (`int`, `float`, `bool`, `str`, or tuples of ints), part of the compile
key. The op's fake (meta) implementation comes from `jax.eval_shape` of the same function, and its
`tpu` implementation is a lowering in the one registry -- so the op runs in strict eager mode,
fuses into the pending graph in defer mode, and compiles inside `torch.compile(backend="tpu")`
graphs. On CPU tensors the function runs through JAX on the host.

`backward="vjp"` registers autograd from `jax.vjp` of the function (as another kernel op, so the
backward runs in every mode too); a callable `backward(primals, cotangents, **static)` returning
one gradient per tensor input (or None) supplies a custom VJP instead -- the way to differentiate
a `pallas_call`, which `jax.vjp` cannot.

On a platform without Mosaic (the CPU stand-in), `pallas_call`s inside the function run in
Pallas's TPU interpret mode automatically; on a TPU they compile to Mosaic as written (untested
here: no TPU). A Helion kernel (`@helion.kernel(backend="pallas", config=...)`, optional extra
`torchtpu[helion]`) is decorated the same way; see `torchtpu.kernels.helion_kernels`.

A kernel that returns the wrong number of outputs, a dtype `tpu` tensors cannot hold, or outputs
that disagree with its `out_spec` raises `KernelError` naming the kernel; one that raises while
traced keeps its exception, with a note naming the kernel and its input shapes.
"""

from torchtpu.kernels.bridge import JaxKernel, KernelError, jax_kernel

__all__ = ["JaxKernel", "KernelError", "jax_kernel"]
