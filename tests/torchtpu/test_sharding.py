"""Sharded tpu tensors: rows spread over the mesh, every op through XLA's SPMD partitioner."""

from __future__ import annotations

import pytest
import torch

import torchtpu
from torchtpu import sharding


@pytest.fixture
def x():
    return torch.randn(8, 3, generator=torch.Generator().manual_seed(0))


def test_shard_roundtrip_and_layout(x):
    s = sharding.shard(x)
    assert s.device == torch.device("tpu:0") and s.shape == x.shape
    assert torch.equal(s.cpu(), x)
    devices = len(sharding.mesh_devices())
    blocks = sharding.local_shards(s)
    assert [row for row, _ in blocks] == list(range(0, 8, 8 // devices))
    assert torch.equal(torch.cat([b for _, b in blocks]), x)


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_ops_keep_rows_sharded_and_mix_with_device_tensors(x, mode):
    with torchtpu.eager_mode(mode):
        s = sharding.shard(x)
        s.mul_(torch.full((3,), 2.0, device="tpu"))  # a tpu:0 operand meets a sharded one
        y = s + 1
        assert torch.equal(y.cpu(), x * 2 + 1)
        assert sharding.to_jax(s).sharding.spec == sharding.flat_sharding().spec
        assert float(s.sum()) == pytest.approx(float((x * 2).sum()), rel=1e-5, abs=1e-5)


@pytest.mark.parametrize("home", ["tpu:0", "tpu:1"])
def test_shard_of_a_tpu_tensor_moves_its_rows_to_their_devices(x, home):
    s = sharding.shard(x.to(home))
    assert torch.equal(s.cpu(), x)
    assert sharding.to_jax(s).sharding.spec == sharding.flat_sharding().spec
    blocks = sharding.local_shards(s)
    assert [row for row, _ in blocks] == [row for row, _ in sharding.local_shards(sharding.shard(x))]
    assert torch.equal(torch.cat([b for _, b in blocks]), x)


def test_from_jax_takes_an_array_on_one_device_or_replicated(x):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    for array in (jax.device_put(x.numpy(), sharding.mesh_devices()[1]),
                  jax.device_put(x.numpy(), NamedSharding(sharding.mesh(), P()))):
        t = sharding.from_jax(array)
        assert torch.equal(t.cpu(), x)
        assert sharding.to_jax(t).sharding.spec == sharding.flat_sharding().spec


def test_from_jax_takes_a_global_array(x):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    array = jax.device_put(x.numpy(), NamedSharding(sharding.mesh(), P(sharding.AXIS)))
    t = sharding.from_jax(array)
    assert torch.equal(t.cpu(), x)


def test_from_process_local_moves_each_block_to_its_device(caplog):
    """One process: its rows are the whole tensor; each device holds its block, laid out as
    `shard` lays it out, and moving it compiles no program (`from_jax` of the same rows as a
    row-sharded array reshapes each device's block with one)."""
    import jax

    x = torch.arange(16 * 7, dtype=torch.float32).reshape(16, 7)  # a shape no other test uses
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        t = sharding.from_process_local(x.numpy())
    assert not [r for r in caplog.records if "ompil" in r.getMessage()], caplog.text
    assert torch.equal(t.cpu(), x)
    assert [row for row, _ in sharding.local_shards(t)] == [row for row, _ in sharding.local_shards(sharding.shard(x))]
    assert sharding.to_jax(t).sharding.spec == sharding.flat_sharding().spec


def test_rows_must_divide_over_the_mesh():
    devices = len(sharding.mesh_devices())
    with pytest.raises(ValueError, match=f"first dimension must be a multiple of {devices}"):
        sharding.shard(torch.ones(devices + 1, 2))
    with pytest.raises(ValueError, match=f"first dimension must be a multiple of {devices}"):
        sharding.from_process_local(torch.ones(devices + 1, 2).numpy())


def _shard_in_two_hosts(rank: int, lock_root: str, coordinator_port: int) -> None:
    """One of two stand-in hosts of two devices each: `shard` of the same tpu tensor keeps this
    host's rows on its devices, and reads back whole."""
    import os

    import stand_in

    os.environ.update(TORCHTPU_LOCK_DIR=os.path.join(lock_root, str(rank)), TORCHTPU_NUM_DEVICES="2",
                      XLA_FLAGS=stand_in.xla_flags(2))
    from torchtpu import runtime

    runtime.configure_distributed(runtime.DistributedConfig(f"127.0.0.1:{coordinator_port}", 2, rank))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))  # every host passes the same
    s = sharding.shard(x.to("tpu:1"))
    assert runtime.runtime().process_count == 2 and len(sharding.mesh_devices()) == 4
    blocks = sharding.local_shards(s)
    assert [row for row, _ in blocks] == [4 * rank, 4 * rank + 2]  # this host's two of four blocks
    assert torch.equal(torch.cat([b for _, b in blocks]), x[4 * rank : 4 * rank + 4])
    assert torch.equal(s.cpu(), x)  # gathered from both hosts (each rank then leaves: `stand_in`)


@pytest.mark.slow
def test_shard_of_a_tpu_tensor_in_a_multi_process_job(tmp_path):
    import stand_in

    stand_in.run_ranks(_shard_in_two_hosts, (str(tmp_path), stand_in.free_port()), 2, 300,
                       "shard in two hosts")
