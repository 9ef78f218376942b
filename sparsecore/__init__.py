"""SparseCore embedding model in JAX and NumPy: topology, specs, layout, host preprocessing."""

from sparsecore.api import SparseCoreEmbedding, differentiable_lookup, make_mesh
from sparsecore.layout import (
    FeaturePlacement,
    StackedTable,
    StackGroup,
    TablePlacement,
    auto_stack_tables,
    physical_row_ids,
    stack_and_shard,
    stack_tables,
    unshard_and_unstack,
)
from sparsecore.optimizers import (
    FTRL,
    SGD,
    Adagrad,
    AdagradMomentum,
    Adam,
    LaProp,
    OptimizerSpec,
    RowWiseAdagrad,
    optimizer_from_name,
)
from sparsecore.preprocess import (
    BufferOverflowError,
    PackedBatch,
    PartitionLimitError,
    PartitionStats,
    RaggedIds,
    update_limits,
)
from sparsecore.spec import (
    Combiner,
    FeatureSpec,
    NamedInitializer,
    TableSpec,
)
from sparsecore.topology import CHIP_PRESETS, ChipSpec, Topology
