"""TPU hardware for TorchRec's planner: a `Topology` of tpu devices from a chip preset.

One TorchRec rank is one JAX device (one process drives one device). Presets are the chips of
`sparsecore.topology` -- "v4", "v5p", "v6e", "tpu7x" -- and "cpu", the stand-in of this
repository's tests (a JAX CPU device playing a chip; its HBM figure is a budget, not a limit).
Per device: HBM capacity and bandwidth, SparseCores; between devices: ICI within a slice
(`local_world_size` devices), DCN across slices. TorchRec counts bandwidths in bytes per
millisecond and memory in bytes.
"""

from __future__ import annotations

from torchrec.distributed.planner.types import Topology

from sparsecore.topology import CHIP_PRESETS, ChipSpec, cpu_chip

__all__ = ["DCN_BANDWIDTH_BYTES_PER_S", "TpuTopology", "chip_preset", "topology"]

DCN_BANDWIDTH_BYTES_PER_S = 25e9
"""Data-centre network bandwidth per device between slices (200 Gbps), the planner's default."""

_CPU_STAND_IN_ICI_BYTES_PER_S = 10e9
"""What the planner assumes between stand-in devices (gloo over loopback is of this order)."""


def chip_preset(name: str) -> ChipSpec:
    """The chip called `name`: a TPU generation of `sparsecore.topology.CHIP_PRESETS` or "cpu"."""
    if name == "cpu":
        return cpu_chip()
    if name not in CHIP_PRESETS:
        raise ValueError(f"unknown chip {name!r}; known: {sorted(CHIP_PRESETS)} and 'cpu' (the stand-in)")
    return CHIP_PRESETS[name]


class TpuTopology(Topology):
    """TorchRec's `Topology` for `world_size` devices of one chip kind, compute device "tpu".

    TorchRec's constructor accepts only cpu/cuda/mtia and fills HBM only for accelerators, so
    it is built as an accelerator topology and then names its device "tpu".
    """

    def __init__(self, chip: ChipSpec, world_size: int, local_world_size: int | None = None,
                 dcn_bandwidth_bytes_per_s: float = DCN_BANDWIDTH_BYTES_PER_S) -> None:
        if world_size <= 0:
            raise ValueError(f"world_size must be positive, got {world_size}")
        local = world_size if local_world_size is None else local_world_size
        if local <= 0 or world_size % local:
            raise ValueError(f"local_world_size ({local}) must be positive and divide world_size ({world_size})")
        ici = chip.ici_bandwidth_bytes_per_s or _CPU_STAND_IN_ICI_BYTES_PER_S
        super().__init__(
            world_size=world_size,
            compute_device="cuda",
            hbm_cap=chip.hbm_bytes_per_device,
            local_world_size=local,
            hbm_mem_bw=chip.hbm_bandwidth_bytes_per_s_per_device / 1000,
            intra_host_bw=ici / chip.devices_per_chip / 1000,
            inter_host_bw=dcn_bandwidth_bytes_per_s / 1000,
            created_by_factory=True,
        )
        self._compute_device = "tpu"
        self.chip = chip

    @property
    def sparsecores_per_device(self) -> int:
        return self.chip.sparsecores_per_device

    def __repr__(self) -> str:
        return f"chip={self.chip.name}\n" + super().__repr__()


def topology(chip: str = "cpu", world_size: int = 1, local_world_size: int | None = None,
             **overrides: float) -> TpuTopology:
    """A planner topology of `world_size` devices of the chip preset `chip` ("v4", "v5p", "v6e",
    "tpu7x" or "cpu"); `local_world_size` devices share a slice's ICI (default: all).
    `overrides`: `dcn_bandwidth_bytes_per_s`."""
    return TpuTopology(chip_preset(chip), world_size, local_world_size, **overrides)
