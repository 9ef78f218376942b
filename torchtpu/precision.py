"""Matmul precision modes, as the TPU's MXU computes them.

The MXU multiplies bf16 values and accumulates in fp32. An fp32 matmul is computed from bf16
splits of its operands, `x = hi + mid + lo` (each part bf16; products of two bf16 values are exact
in fp32):

- `default`: 1 pass, hi*hi (fp32 inputs rounded to bf16);
- `high`:    3 passes, hi*hi + hi*mid + mid*hi;
- `highest`: 6 passes, adding hi*lo + lo*hi + mid*mid (about fp32 accuracy).

On a TPU, XLA performs these passes itself when given `lax.Precision`. Everywhere else they are
computed explicitly here, so that results on the CPU stand-in match a TPU's up to accumulation
order. Inputs that are already bf16 (or f16) take one pass in every mode; float64 and integer
matmuls are exact.

How a pass runs on the CPU stand-in depends on the host: where the CPU multiplies bf16 natively
with fp32 accumulation (x86 `avx512_bf16`/`amx_bf16`, Arm `bf16`), XLA:CPU's bf16 dot is the
fastest kernel and the pass is exactly the MXU's; elsewhere XLA:CPU emulates bf16 slowly, and the
pass widens its bf16 parts to fp32 instead (same products, see `_exact_f32`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform as _platform
from typing import Any, Callable, Iterator

import jax.numpy as jnp
import numpy as np
from jax import lax

MODES = ("default", "high", "highest")
_PASSES = {"default": ((0, 0),), "high": ((0, 0), (0, 1), (1, 0)),
           "highest": ((0, 0), (0, 1), (1, 0), (0, 2), (2, 0), (1, 1))}
_LAX_PRECISION = {"default": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
                  "highest": lax.Precision.HIGHEST}


class _State:
    """Process-wide, like `torch.set_float32_matmul_precision`: the autograd engine can run backward
    ops on its own thread (see `torchtpu.device`), and they must use the mode the forward ran under."""

    mode = "default"


_state = _State()


def _check(mode: str) -> str:
    if hasattr(mode, "value"):  # torch.tpu.Precision enum members
        mode = mode.value
    mode = str(mode).lower()
    if mode not in MODES:
        raise ValueError(f"unknown matmul precision {mode!r}; expected one of {MODES}")
    return mode


# Called with the new mode after every change (the C++ fast path keys calls by it).
on_change: list[Callable[[str], None]] = []


def get_mode() -> str:
    return _state.mode


def set_mode(mode: str) -> None:
    _state.mode = _check(mode)
    for listener in on_change:
        listener(_state.mode)


@contextlib.contextmanager
def precision(mode: str) -> Iterator[None]:
    """Context manager: run matmuls in `mode` inside the block."""
    previous = _state.mode
    set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def _split(x, parts: int):
    """bf16 parts of an fp32 array: x ~= parts[0] + parts[1] + ... (each exactly bf16)."""
    out = []
    rest = x
    for _ in range(parts):
        part = rest.astype(jnp.bfloat16)
        out.append(part)
        rest = rest - part.astype(jnp.float32)
    return out


def _exact_f32(part):
    """A bf16 (or f16) pass operand widened to fp32 for the CPU stand-in.

    The product of two bf16 values (8-bit significands) or two f16 values (11-bit) is exact in
    fp32 (24-bit), so multiplying the widened parts with fp32 accumulation computes exactly what
    the MXU computes, while XLA:CPU runs its fast fp32 kernels instead of emulating bf16 ones.
    """
    return part.astype(jnp.float32)


@functools.cache
def host_has_bf16_dot() -> bool:
    """Whether this host's CPU multiplies bf16 natively with fp32 accumulation, so that XLA:CPU's
    bf16 dot beats widening to fp32 (measured on a Sapphire Rapids host: 2-2.5x on DLRM-sized
    matmuls; on a Zen 1 host without the instructions, the bf16 dot is the slower one).

    `TORCHTPU_CPU_BF16_DOT=0|1` overrides the detection (read once per process).
    """
    forced = os.environ.get("TORCHTPU_CPU_BF16_DOT") or None  # empty: not set
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"TORCHTPU_CPU_BF16_DOT must be 0 or 1, got {forced!r}")
        return forced == "1"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = set()
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    flags.update(line.split(":", 1)[1].split())
    except OSError:
        return False
    if _platform.machine().lower() in ("aarch64", "arm64"):
        return "bf16" in flags
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def dot_general(a, b, dimension_numbers, mode: str, platform: str, out_dtype=None, *,
                rhs_transposed: bool = False):
    """`lax.dot_general` with TPU matmul precision semantics for floating-point inputs.
    `rhs_transposed`: `b` is the transpose (last two dimensions) of a row-major array, such as a
    `w.t()` view, a layout hint for the CPU stand-in's bf16 dot."""
    native = platform != "tpu" and host_has_bf16_dot()
    if native:
        op = functools.partial(_row_major_bf16_dot, dimension_numbers=dimension_numbers,
                               rhs_transposed=rhs_transposed)
    else:
        op = functools.partial(lax.dot_general, dimension_numbers=dimension_numbers)
    return bilinear(op, a, b, mode, platform, out_dtype, native_bf16=native)


def _row_major(x):
    """`x` with a row-major layout: the barrier keeps XLA from folding a producer's transpose
    into the layout (a free reshape when `x` is row-major already)."""
    return lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def _row_major_bf16_dot(a, b, dimension_numbers, rhs_transposed: bool = False, **kwargs):
    """`lax.dot_general` of bf16 operands, shaped for XLA:CPU's native bf16 dot.

    That kernel (YNNPACK) takes row-major operands, the left one contracting its last dimension,
    the right one either; XLA:CPU widens any other bf16 dot to fp32 -- a transposed weight
    (`x @ w.t()`), a weight gradient (`g.t() @ x`) -- at a third of the speed. A matmul with
    leading batch dimensions, one free and one contracting dimension per operand is rearranged:
    the left operand copied into that form, the right one read as stored when `rhs_transposed`
    says it is a transpose (XLA cancels the two transposes; `w.t()` costs no copy), else copied
    row-major as it is. Other shapes go to `lax.dot_general` as they are.
    """
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    batch = tuple(range(len(lhs_batch)))
    if (a.dtype != jnp.bfloat16 or b.dtype != jnp.bfloat16 or tuple(lhs_batch) != batch
            or tuple(rhs_batch) != batch or a.ndim != len(batch) + 2 or b.ndim != len(batch) + 2
            or len(lhs_contract) != 1):
        return lax.dot_general(a, b, dimension_numbers, **kwargs)
    (contract,) = lhs_contract
    if contract != a.ndim - 1:
        a = lax.transpose(a, (*batch, a.ndim - 1, contract))
    (rhs_dim,) = rhs_contract
    if rhs_transposed:
        b = jnp.swapaxes(b, -1, -2)
        rhs_dim = 2 * b.ndim - 3 - rhs_dim  # the other of the last two dimensions
    dimension_numbers = (((a.ndim - 1,), (rhs_dim,)), (batch, batch))
    return lax.dot_general(_row_major(a), _row_major(b), dimension_numbers, **kwargs)


def conv_general_dilated(lhs, rhs, mode: str, platform: str, out_dtype=None, **conv):
    """`lax.conv_general_dilated` (keyword arguments `conv`) with TPU precision semantics:
    a convolution is a contraction, so it takes the same bf16 passes as a matmul. Its passes are
    widened to fp32 on every CPU host: XLA:CPU's bf16 convolution is not faster even where the
    CPU multiplies bf16 natively."""
    return bilinear(functools.partial(lax.conv_general_dilated, **conv), lhs, rhs, mode, platform,
                    out_dtype, native_bf16=False)


def bilinear(op: Callable[..., Any], a, b, mode: str, platform: str, out_dtype=None, *,
             native_bf16: bool = False):
    """`op(a, b, precision=, preferred_element_type=)`, a lax op linear in each operand, computed
    as the TPU's MXU computes it in precision `mode`: 1, 3 or 6 bf16 passes for fp32 operands,
    one pass for bf16/f16 operands (fp32 accumulation), exact for float64 and integers.

    Off TPU, `native_bf16` runs each pass on bf16 operands (the host multiplies bf16 natively);
    otherwise a pass widens its operands to fp32 first. Both give the exact products."""
    out_dtype = np.dtype(out_dtype or jnp.result_type(a, b))
    if out_dtype not in (np.float32, np.dtype(jnp.bfloat16), np.float16):
        # float64 and integers: exact, no bf16 passes.
        return op(a, b, preferred_element_type=out_dtype)
    if platform == "tpu":
        # UNTESTED (no TPU here): XLA:TPU performs the bf16 passes itself.
        result = op(a, b, precision=_LAX_PRECISION[mode], preferred_element_type=jnp.float32)
        return result.astype(out_dtype)
    widen = (lambda part: part) if native_bf16 else _exact_f32
    if a.dtype != np.float32 and b.dtype != np.float32:
        # bf16/f16 operands: one pass, products accumulated in fp32 (exact fp32 products, see
        # `_exact_f32`). f16 and mixed operands are widened: only the bf16 dot is known to
        # accumulate in fp32 natively here.
        if a.dtype != b.dtype or a.dtype != jnp.bfloat16:
            widen = _exact_f32
        return op(widen(a), widen(b), preferred_element_type=jnp.float32).astype(out_dtype)
    passes = _PASSES[mode]
    depth = 1 + max(max(p) for p in passes)
    a_parts = _split(a.astype(jnp.float32), depth)
    b_parts = _split(b.astype(jnp.float32), depth)
    total = None
    # Add the small terms first, as the MXU's fp32 accumulation of the passes does.
    for i, j in reversed(passes):
        term = op(widen(a_parts[i]), widen(b_parts[j]), preferred_element_type=jnp.float32)
        total = term if total is None else total + term
    return total.astype(out_dtype)
