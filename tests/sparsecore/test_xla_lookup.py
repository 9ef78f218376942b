"""The XLA stand-in lookup (`sparsecore.kernels.lookup`), selected with `lookup_impl="xla"`.

On the CPU stand-in engines default to the C++ lookup (`sparsecore.kernels.cpu`), so the XLA
loop -- the lookup of every platform without a kernel of its own -- is tested here: selected as
the lookup of every engine in this module, it passes `test_numerics`' forward tests against
`torch.nn.EmbeddingBag` and the NumPy combiner model, and `test_kernels`' random topologies
(NumPy model, bit-identical results with garbage outside the partitions, random loop tiling)
on 1, 2 and 8 devices.
"""
from __future__ import annotations

from test_kernels import (  # noqa: F401  (collected here, with the XLA lookup selected)
    lookup_selected,
    test_random_topologies_match_numpy_model_even_with_garbage,
    tiny_lookup,
)
from test_numerics import (  # noqa: F401
    forward_run,
    pooled_model,
    random_ids,
    test_forward_matches_numpy_combiner_model,
    test_forward_matches_torch_embedding_bag,
    test_sequence_feature_returns_every_position_and_zero_padding,
)

xla_lookup_selected = lookup_selected("xla")


def test_engines_here_run_no_custom_call():
    assert "custom_call" not in tiny_lookup()
