"""SparseCore embedding model in JAX and NumPy: topology, specs, layout, host preprocessing."""

from sparsecore.spec import (
    Combiner,
    FeatureSpec,
    NamedInitializer,
    TableSpec,
)
from sparsecore.topology import CHIP_PRESETS, ChipSpec, Topology
