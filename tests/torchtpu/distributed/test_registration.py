"""`import torchtpu` registers tpu_dist with torch.distributed for the `tpu` device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import torchtpu


def test_tpu_dist_is_the_backend_of_tpu_devices():
    assert "tpu_dist" in dist.Backend.backend_list
    assert dist.Backend.default_device_backend_map["tpu"] == "tpu_dist"
    assert dist.Backend.backend_capability["tpu_dist"] == ["tpu"]
    assert dist.Backend.backend_type_map["tpu_dist"] == dist.ProcessGroup.BackendType.CUSTOM


def test_a_collective_before_init_process_group_says_so():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="Default process group has not been initialized"):
        dist.all_reduce(torch.ones(2, device="tpu:0"))


def test_the_default_group_answers_its_name(tmp_path):
    """c10d never names a Python group standing for a whole backend; `group_name` (which
    TorchRec's ShardingEnv and DeviceMesh read) answers with the name it registered."""
    dist.init_process_group("cpu:gloo,tpu:tpu_dist", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group.group_name == dist.distributed_c10d._get_process_group_name(group) == "0"
        sub = dist.new_group([0], backend="tpu_dist")
        assert sub.group_name == dist.distributed_c10d._get_process_group_name(sub) != group.group_name
    finally:
        dist.destroy_process_group()


def test_functional_collectives_run_between_the_compiled_pieces(tmp_path):
    """`torch.distributed`'s functional collectives (DTensor's, and what a compiled model's
    collectives become) on tpu tensors, eager and inside `torch.compile(backend="tpu")`: the
    graph runs as pieces around the collective, which tpu_dist runs as in eager mode, with no
    warning of a missing lowering."""
    dist.init_process_group("tpu_dist", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        x = torch.arange(4.0).to("tpu")
        assert funcol.all_reduce(x, "sum", dist.group.WORLD).cpu().tolist() == [0.0, 1.0, 2.0, 3.0]
        torchtpu.reset_metrics()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            compiled = torch.compile(lambda t: funcol.all_reduce(t * 2, "sum", dist.group.WORLD) + 1, backend="tpu")
            assert compiled(x).cpu().tolist() == [1.0, 3.0, 5.0, 7.0]
        assert torchtpu.metrics()["compiled_graphs_split"] == 1
    finally:
        dist.destroy_process_group()
