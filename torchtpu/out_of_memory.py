"""Running out of device memory raises `torch.OutOfMemoryError`, as on CUDA.

The runtime reports it as XLA's RESOURCE_EXHAUSTED status (a `jax.errors.JaxRuntimeError`): when
a program's buffers are allocated, when a program too large for the device is compiled, or when
data is placed on the device. Code written for CUDA catches `torch.cuda.OutOfMemoryError`, which
is `torch.OutOfMemoryError` (batch-size finders, for one). torchtpu raises that class (also named
`torch.tpu.OutOfMemoryError`), caused by the runtime's error, wherever device memory is taken:
the executors' program calls (`exec.eager`, `exec.deferred` and the C++ fast path, which calls
`as_torch`), transfers to the device (`exec.memory`, `sharding`) and the SparseCore tables'
creation (`embeddings.state`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator, NoReturn

import torch


def is_out_of_memory(error: BaseException) -> bool:
    """`error` is the runtime's report that device memory ran out."""
    jax_errors = sys.modules.get("jax.errors")  # no JAX error without JAX
    return (jax_errors is not None and isinstance(error, jax_errors.JaxRuntimeError)
            and str(error).startswith("RESOURCE_EXHAUSTED"))


def as_torch(error: BaseException) -> BaseException:
    """`error`, or torch's out-of-memory error caused by it where it is one."""
    if not is_out_of_memory(error):
        return error
    translated = torch.OutOfMemoryError(f"tpu out of memory: {error}")
    translated.__cause__ = error
    return translated


def reraise(error: RuntimeError) -> NoReturn:
    """Raise `error` again (from its `except` block), as torch's out-of-memory error where it is
    one: the executors' way, where a `with` block would cost each call."""
    translated = as_torch(error)
    if translated is error:
        raise error
    raise translated from error


@contextlib.contextmanager
def raised_as_torch() -> Iterator[None]:
    """The block's out-of-memory error raised as torch's (any other error as it is)."""
    try:
        yield
    except RuntimeError as error:
        reraise(error)
