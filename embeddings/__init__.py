"""Fused, sharded SparseCore embedding collections on `tpu`, with TorchRec types in and out."""

from embeddings.config import SparseCoreEmbeddingConfig
from embeddings.distributed import join_process_mesh
from embeddings.input import SparseCoreBatch, SparseCorePreprocessor
from embeddings.loader import PrefetchingLoader
from embeddings.modules import SparseCoreEmbeddingBagCollection, SparseCoreEmbeddingCollection, runtime_topology
from embeddings.optim import SparseCoreFusedOptimizer

__all__ = [
    "PrefetchingLoader",
    "SparseCoreBatch",
    "SparseCoreEmbeddingBagCollection",
    "SparseCoreEmbeddingCollection",
    "SparseCoreEmbeddingConfig",
    "SparseCoreFusedOptimizer",
    "SparseCorePreprocessor",
    "join_process_mesh",
    "runtime_topology",
]
