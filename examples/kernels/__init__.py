"""Custom kernels as torch ops on `tpu`: JAX/Pallas examples for `torchtpu.kernels.jax_kernel`."""
