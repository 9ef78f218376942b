"""Per-device random number generator state.

Each `tpu` device has a generator of (seed, offset). Every random op consumes one offset and
derives its PRNG key inside the compiled program as `fold_in(key(seed), offset)` (threefry, the
same stream on every platform), so the key is a runtime input: changing it never recompiles, and
the deferred executor, which draws offsets when an op is recorded, produces the same streams as
strict eager mode.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

_DEFAULT_SEED = 67280421310721  # torch's default CPU seed


class _Generator:
    __slots__ = ("seed", "offset")

    def __init__(self, seed: int = _DEFAULT_SEED) -> None:
        self.seed = seed
        self.offset = 0


_generators: dict[int, _Generator] = {}
_lock = threading.Lock()


def _generator(device: int) -> _Generator:
    gen = _generators.get(device)
    if gen is None:
        with _lock:
            gen = _generators.setdefault(device, _Generator())
    return gen


def next_key_words(device: int, generator: torch.Generator | None = None) -> np.ndarray:
    """The key input for one random op on `device`: uint32 [seed_hi, seed_lo, off_hi, off_lo],
    from the device's generator, or from `generator` (a `torch.Generator(device="tpu")`, whose
    C++ state is the same (seed, offset) pair: torchtpu/csrc/device_guard.cpp)."""
    if generator is None:
        gen = _generator(device)
        seed, offset = gen.seed, gen.offset
        gen.offset += 1
    else:
        seed, offset = generator.initial_seed(), generator.get_offset()
        generator.set_offset(offset + 1)
    seed &= 0xFFFFFFFFFFFFFFFF
    return np.array([seed >> 32, seed & 0xFFFFFFFF, offset >> 32, offset & 0xFFFFFFFF], np.uint32)


def key_from_words(words):
    """Inside a traced program: the PRNG key for the words `next_key_words` produced."""
    import jax

    base = jax.random.wrap_key_data(words[:2], impl="threefry2x32")
    return jax.random.fold_in(jax.random.fold_in(base, words[2]), words[3])


def manual_seed(seed: int, device: int) -> None:
    gen = _generator(device)
    gen.seed = int(seed)
    gen.offset = 0


def initial_seed(device: int) -> int:
    return _generator(device).seed


def get_state(device: int) -> torch.Tensor:
    """The generator state as a CPU uint8 tensor (16 bytes: seed, offset), like CUDA's."""
    gen = _generator(device)
    words = np.array([gen.seed & 0xFFFFFFFFFFFFFFFF, gen.offset], dtype=np.uint64)
    return torch.from_numpy(words.view(np.uint8).copy())


def set_state(state: torch.Tensor, device: int) -> None:
    if state.dtype != torch.uint8 or state.numel() != 16:
        raise ValueError("a tpu RNG state is a uint8 tensor of 16 bytes (from torch.tpu.get_rng_state)")
    seed, offset = state.cpu().numpy().copy().view(np.uint64)
    gen = _generator(device)
    gen.seed, gen.offset = int(seed), int(offset)
