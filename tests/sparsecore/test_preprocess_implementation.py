"""Choosing the host-preprocessing implementation: compiled where it builds, NumPy otherwise,
never silently. (Both implementations' results are tested in test_preprocess, test_golden and
test_roundtrip, each run once per implementation.)"""

from __future__ import annotations

import numpy as np
import pytest

from sparsecore.layout import stack_tables
from sparsecore.preprocess import RaggedIds, native, pipeline, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

TOPOLOGY = Topology.cpu(1, 2)
STACKS = stack_tables([FeatureSpec("f", TableSpec("t", 64, 8), 4)], TOPOLOGY)
INPUTS = {"f": RaggedIds(np.array([3, 5, 3, 9]), lengths=np.array([2, 1, 0, 1]))}


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="implementation must be 'auto', 'native' or 'numpy', got 'c'"):
        preprocess(STACKS, INPUTS, TOPOLOGY, implementation="c")


def test_native_without_a_compiler_raises_and_auto_warns_then_uses_numpy(monkeypatch):
    monkeypatch.setattr(native, "build_error", lambda: "no C++ compiler (c++ or g++ on PATH, or $CXX)")
    with pytest.raises(RuntimeError, match="compiled preprocessing is unavailable: no C\\+\\+ compiler"):
        preprocess(STACKS, INPUTS, TOPOLOGY, implementation="native")
    with pytest.warns(UserWarning, match="compiled host preprocessing is unavailable .*preprocessing with NumPy"):
        assert pipeline._auto_native.__wrapped__() is False


def test_auto_is_the_compiled_path_here_and_both_agree():
    assert native.build_error() is None
    assert pipeline._native_selected("auto")
    auto = preprocess(STACKS, INPUTS, TOPOLOGY)["t"]
    numpy = preprocess(STACKS, INPUTS, TOPOLOGY, implementation="numpy")["t"]
    for field in ("row_pointers", "embedding_ids", "sample_ids", "gains"):
        np.testing.assert_array_equal(getattr(auto, field), getattr(numpy, field))
    for field in ("unique_ids", "unique_counts", "entry_unique_index"):
        np.testing.assert_array_equal(getattr(auto.unique, field), getattr(numpy.unique, field))
