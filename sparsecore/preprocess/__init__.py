"""Host preprocessing: ragged ids per feature -> static SparseCore buffers per stacked table."""

from sparsecore.preprocess.pack import PAD_ID, BufferOverflowError, BufferSizes, buffer_sizes
from sparsecore.preprocess.partition import PartitionLimitError
from sparsecore.preprocess.pipeline import PackedBatch, preprocess, preprocess_stack
from sparsecore.preprocess.ragged import RaggedIds
from sparsecore.preprocess.stats import PartitionStats, update_limits
from sparsecore.preprocess.unique_rows import UniqueRows
