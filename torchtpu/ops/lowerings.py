"""Imports every family of lowerings, which fills the registry."""

from torchtpu.ops import (  # noqa: F401
    activations,
    comparison,
    conv,
    creation,
    data_dependent,
    foreach,
    embedding,
    indexing,
    linalg,
    nn,
    pointwise,
    pooling,
    random,
    reduction,
    shape,
    sorting,
    special,
    views,
)
