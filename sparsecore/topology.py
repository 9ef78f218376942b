"""TPU hardware as SparseCore embedding code sees it: chips, JAX devices and SparseCores.

A `ChipSpec` describes one TPU generation; a `Topology` is a number of JAX devices of one chip
kind, of which this host drives `local_device_count`. Counts on `ChipSpec` are PER CHIP unless the
name says otherwise: tpu7x exposes two JAX devices per chip, so its four SparseCores per chip are
two per JAX device. Everything downstream (sharding, buffers, the planner) works in JAX devices,
through `ChipSpec.sparsecores_per_device` and `Topology.sparsecores_per_device`.

Numbers come from the team notes (`notes/sparsecore.md`, which cite Cloud TPU pages); v4's ICI
figure is Cloud TPU's 2400 Gbps per direction, which the notes leave blank. The embedding-dim
alignment of v6e and tpu7x (16) follows the notes' "16 on newer chips"; the open-source anchor pads
to 8 everywhere, so 16 is the safe choice there (more padding never changes results). None of this
has been checked on hardware from this repository.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1 << 30

__all__ = [
    "GIB",
    "ChipSpec",
    "Topology",
    "TPU_V4",
    "TPU_V5P",
    "TPU_V6E",
    "TPU7X",
    "CHIP_PRESETS",
    "cpu_chip",
    "is_power_of_two",
]


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ...; False for 0 and negatives."""
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class ChipSpec:
    """One TPU generation (or the CPU stand-in). Per-chip figures unless named per device."""

    name: str
    sparsecores_per_chip: int
    devices_per_chip: int
    hbm_bytes_per_chip: int
    hbm_bandwidth_bytes_per_s: float
    ici_bandwidth_bytes_per_s: float | None
    embedding_dim_alignment: int
    is_tpu: bool = True

    def __post_init__(self) -> None:
        for field in ("sparsecores_per_chip", "devices_per_chip", "hbm_bytes_per_chip"):
            if getattr(self, field) <= 0:
                value = getattr(self, field)
                raise ValueError(f"ChipSpec {self.name!r}: {field} must be positive, got {value}")
        if self.sparsecores_per_chip % self.devices_per_chip:
            raise ValueError(
                f"ChipSpec {self.name!r}: {self.sparsecores_per_chip} SparseCores per chip do not "
                f"split evenly over {self.devices_per_chip} JAX devices per chip"
            )
        if not is_power_of_two(self.embedding_dim_alignment):
            raise ValueError(
                f"ChipSpec {self.name!r}: embedding_dim_alignment must be a power of two, "
                f"got {self.embedding_dim_alignment}"
            )

    @property
    def sparsecores_per_device(self) -> int:
        """SparseCores one JAX device drives (what sharding and buffers count in)."""
        return self.sparsecores_per_chip // self.devices_per_chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def hbm_bandwidth_bytes_per_s_per_device(self) -> float:
        return self.hbm_bandwidth_bytes_per_s / self.devices_per_chip


TPU_V4 = ChipSpec(
    name="v4",
    sparsecores_per_chip=4,
    devices_per_chip=1,
    hbm_bytes_per_chip=32 * GIB,
    hbm_bandwidth_bytes_per_s=1.2e12,
    ici_bandwidth_bytes_per_s=0.6e12,
    embedding_dim_alignment=8,
)
TPU_V5P = ChipSpec(
    name="v5p",
    sparsecores_per_chip=4,
    devices_per_chip=1,
    hbm_bytes_per_chip=95 * GIB,
    hbm_bandwidth_bytes_per_s=2.77e12,
    ici_bandwidth_bytes_per_s=1.2e12,
    embedding_dim_alignment=8,
)
TPU_V6E = ChipSpec(
    name="v6e",
    sparsecores_per_chip=2,
    devices_per_chip=1,
    hbm_bytes_per_chip=32 * 10**9,
    hbm_bandwidth_bytes_per_s=1.64e12,
    ici_bandwidth_bytes_per_s=0.8e12,
    embedding_dim_alignment=16,
)
TPU7X = ChipSpec(
    name="tpu7x",
    sparsecores_per_chip=4,
    devices_per_chip=2,
    hbm_bytes_per_chip=192 * GIB,
    hbm_bandwidth_bytes_per_s=7.4e12,
    ici_bandwidth_bytes_per_s=1.2e12,
    embedding_dim_alignment=16,
)

CHIP_PRESETS: dict[str, ChipSpec] = {chip.name: chip for chip in (TPU_V4, TPU_V5P, TPU_V6E, TPU7X)}


def cpu_chip(
    sparsecores_per_device: int = 4,
    hbm_bytes: int = 16 * GIB,
    hbm_bandwidth_bytes_per_s: float = 20e9,
    embedding_dim_alignment: int = 8,
) -> ChipSpec:
    """The CPU stand-in: one JAX CPU device plays a chip with `sparsecores_per_device` SparseCores.

    `hbm_bytes` is the memory budget the planner may assume per stand-in device; it is not
    enforced. The bandwidth default is roughly this machine's memory copy rate.
    """
    return ChipSpec(
        name="cpu",
        sparsecores_per_chip=sparsecores_per_device,
        devices_per_chip=1,
        hbm_bytes_per_chip=hbm_bytes,
        hbm_bandwidth_bytes_per_s=hbm_bandwidth_bytes_per_s,
        ici_bandwidth_bytes_per_s=None,
        embedding_dim_alignment=embedding_dim_alignment,
        is_tpu=False,
    )


@dataclass(frozen=True)
class Topology:
    """`global_device_count` JAX devices of one chip kind; this host drives `local_device_count`.

    The total SparseCore count N = global devices x SparseCores per device is the number of MOD
    shards of every table and must be a power of two. `local_device_count` defaults to all
    devices (single host); with several hosts each host preprocesses its own slice of the batch.
    """

    chip: ChipSpec
    global_device_count: int
    local_device_count: int | None = None

    def __post_init__(self) -> None:
        if self.local_device_count is None:
            object.__setattr__(self, "local_device_count", self.global_device_count)
        if self.global_device_count <= 0:
            raise ValueError(
                f"global_device_count must be positive, got {self.global_device_count}"
            )
        if self.local_device_count <= 0 or self.global_device_count % self.local_device_count:
            raise ValueError(
                f"local_device_count ({self.local_device_count}) must be positive and divide "
                f"global_device_count ({self.global_device_count})"
            )
        if not is_power_of_two(self.num_sparsecores):
            raise ValueError(
                f"Total number of SparseCores ({self.num_sparsecores} = "
                f"{self.global_device_count} devices x {self.sparsecores_per_device} SparseCores "
                "per device) must be a power of 2."
            )

    @classmethod
    def preset(
        cls, name: str, global_device_count: int, local_device_count: int | None = None
    ) -> Topology:
        """A topology of a named TPU generation ("v4", "v5p", "v6e", "tpu7x")."""
        if name not in CHIP_PRESETS:
            raise ValueError(f"unknown TPU generation {name!r}; known: {sorted(CHIP_PRESETS)}")
        return cls(CHIP_PRESETS[name], global_device_count, local_device_count)

    @classmethod
    def cpu(
        cls,
        global_device_count: int,
        sparsecores_per_device: int = 4,
        local_device_count: int | None = None,
        hbm_bytes: int = 16 * GIB,
    ) -> Topology:
        """The CPU stand-in topology (JAX CPU devices playing TPU chips)."""
        chip = cpu_chip(sparsecores_per_device=sparsecores_per_device, hbm_bytes=hbm_bytes)
        return cls(chip, global_device_count, local_device_count)

    def with_devices(
        self, global_device_count: int, local_device_count: int | None = None
    ) -> Topology:
        """The same chip kind with another device count (e.g. to reload a checkpoint elsewhere)."""
        return dataclasses.replace(
            self, global_device_count=global_device_count, local_device_count=local_device_count
        )

    @property
    def sparsecores_per_device(self) -> int:
        return self.chip.sparsecores_per_device

    @property
    def num_sparsecores(self) -> int:
        """N: SparseCores over all devices, i.e. MOD shards and partitions per table."""
        return self.global_device_count * self.sparsecores_per_device

    @property
    def local_sparsecores(self) -> int:
        """SparseCores driven by this host (local devices x SparseCores per device)."""
        return self.local_device_count * self.sparsecores_per_device

    @property
    def num_hosts(self) -> int:
        return self.global_device_count // self.local_device_count

    @property
    def row_pointers_per_sparsecore(self) -> int:
        """R = max(N, 8): row-pointer slots per SparseCore in the packed buffers."""
        return max(self.num_sparsecores, 8)

    @property
    def embedding_dim_alignment(self) -> int:
        return self.chip.embedding_dim_alignment
