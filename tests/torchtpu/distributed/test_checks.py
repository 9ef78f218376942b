"""Argument checks of tpu_dist, in one process: what each rank rejects on its own, and the verdict
every rank reaches from the gathered all-to-all sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchtpu.distributed import checks


def _table(sends: list[list[int]], recvs: list[list[int]], row_numels=None, dtypes=None) -> np.ndarray:
    world = len(sends)
    rows = [
        checks.exchange_values(sends[r], recvs[r], (row_numels or [2] * world)[r], (dtypes or [torch.float32] * world)[r])
        for r in range(world)
    ]
    return np.array(rows, dtype=np.int64)


def test_agreeing_sizes_give_each_rank_its_splits():
    sends = [[1, 0, 2], [0, 0, 5], [3, 1, 0]]
    recvs = np.array(sends).T.tolist()
    sizes = checks.check_exchange_table("all_to_all_single", _table(sends, recvs), "rows", "in", "out")
    assert sizes.row_numel == 2
    assert sizes.splits(0) == ([1, 0, 2], [1, 0, 3])
    assert sizes.splits(2) == ([3, 1, 0], [2, 5, 0])


def test_disagreeing_sizes_name_both_ranks_and_both_arguments():
    sends = [[1, 2], [1, 2]]
    recvs = [[1, 2], [1, 3]]
    with pytest.raises(ValueError) as error:
        checks.check_exchange_table("all_to_all_single", _table(sends, recvs), "rows",
                                    "input_split_sizes", "output_split_sizes")
    message = str(error.value)
    assert ("rank 0 sends 2 rows to rank 1 (input_split_sizes[1]) but rank 1 expects 1 from rank 0 "
            "(output_split_sizes[0])") in message
    assert "rank 1 sends 2 rows to rank 1 (input_split_sizes[1]) but rank 1 expects 3" in message


def test_many_disagreements_are_summarised():
    world = 4
    sends = [[1] * world for _ in range(world)]
    recvs = [[2] * world for _ in range(world)]
    with pytest.raises(ValueError, match="and 12 more"):
        checks.check_exchange_table("all_to_all", _table(sends, recvs), "elements", "a", "b")


def test_ranks_must_agree_on_dtype_and_row_size():
    even = [[1, 1], [1, 1]]
    with pytest.raises(ValueError, match=r"disagree on the dtype \(rank 0: torch.float32, rank 1: torch.int64\)"):
        checks.check_exchange_table("x", _table(even, even, dtypes=[torch.float32, torch.int64]), "rows", "a", "b")
    with pytest.raises(ValueError, match=r"disagree on the elements per row \(rank 0: 2, rank 1: 3\)"):
        checks.check_exchange_table("x", _table(even, even, row_numels=[2, 3]), "rows", "a", "b")


def test_split_sizes():
    t = torch.empty(6, 2, device="meta")
    assert checks.split_sizes("c", "input_split_sizes", t, "input", [], 3) == [2, 2, 2]
    assert checks.split_sizes("c", "input_split_sizes", t, "input", [0, 6], 2) == [0, 6]
    with pytest.raises(ValueError, match="does not divide by 4 ranks"):
        checks.split_sizes("c", "input_split_sizes", t, "input", [], 4)
    with pytest.raises(ValueError, match="has 2 entries, expected one per rank \\(3\\)"):
        checks.split_sizes("c", "input_split_sizes", t, "input", [3, 3], 3)
    with pytest.raises(ValueError, match="negative"):
        checks.split_sizes("c", "input_split_sizes", t, "input", [7, -1], 2)
    with pytest.raises(ValueError, match=r"\[2, 2\] sum to 4 rows, but dim 0 of the input has 6 rows"):
        checks.split_sizes("c", "input_split_sizes", t, "input", [2, 2], 2)
    with pytest.raises(ValueError, match="must have a dim 0"):
        checks.split_sizes("c", "input_split_sizes", torch.empty((), device="meta"), "input", [], 2)


def test_placement():
    cpu = torch.empty(2)
    tpu = torch.empty(2, device="tpu:0")
    assert checks.placement("c", [tpu, tpu], serves_cpu=False) == torch.device("tpu", 0)
    assert checks.placement("c", [cpu], serves_cpu=True) == torch.device("cpu")
    with pytest.raises(RuntimeError, match="serves tpu tensors only"):
        checks.placement("all_reduce", [cpu], serves_cpu=False)
    with pytest.raises(RuntimeError, match="found tpu:0 and cpu"):
        checks.placement("all_gather", [tpu, cpu], serves_cpu=True)
    with pytest.raises(RuntimeError, match="meta are not supported"):
        checks.placement("all_reduce", [torch.empty(2, device="meta")], serves_cpu=True)


def test_shape_checks():
    a, b = torch.empty(3, device="meta"), torch.empty(4, device="meta")
    with pytest.raises(ValueError, match=r"tensor_list\[1\] has shape \(4,\), but tensor has shape \(3,\)"):
        checks.same_shapes("all_gather", "tensor_list", [a, b], a, "tensor")
    with pytest.raises(ValueError, match="has 4 elements, expected 2 ranks x 3 elements"):
        checks.world_multiple("all_gather_into_tensor", b, "output_tensor", a, "input_tensor", 2)
    with pytest.raises(ValueError, match="one dtype"):
        checks.same_dtype("c", [a, torch.empty(3, dtype=torch.int64, device="meta")])
    with pytest.raises(ValueError, match=r"input rows have shape \(2,\) but output rows have shape \(3,\)"):
        checks.row_shapes("c", torch.empty(4, 3, device="meta"), torch.empty(4, 2, device="meta"))
