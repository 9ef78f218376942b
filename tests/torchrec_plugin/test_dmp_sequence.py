"""TorchRec's `EmbeddingCollection` under `DistributedModelParallel` on `tpu` with the plugin's
sharders, driven by `TrainPipelineSparseDist`, against TorchRec on CPU over gloo (its own EC
sharder and FBGEMM's CPU kernels; DDP over its unsharded EC for the data-parallel table) taking
the same steps one by one: same plan -- table-wise, row-wise, column-wise and data-parallel
tables --, initial weights and batches; each step's loss and sequences (values and lengths) and
the tables and Adagrad state after 5 fused steps agree within 1e-5. A distributed checkpoint of
the tpu model restores bit-exactly into a model of other weights, which trains on identically; a
sample longer than its table's `max_seq_len` is refused naming it (`_ec_workers`, one spawn of two
ranks). Without a spawn: the sharder's `max_seq_len` setting and the planner on a model holding
an EmbeddingCollection."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torch import nn

import torchrec_plugin
from torchrec_plugin.estimators import shard_cost
from torchrec_plugin.sequence_lengths import sequence_lengths

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "embeddings"))

import _ec_workers  # noqa: E402
from _spawn import run_processes  # noqa: E402

BATCH_PER_RANK = 8


@pytest.mark.slow
def test_two_ranks_match_torchrec_checkpoint_and_pipeline(tmp_path):
    run_processes(_ec_workers.compare_with_torchrec, 2, 1, BATCH_PER_RANK, str(tmp_path / "checkpoint"), timeout=900)


def test_max_seq_len_setting():
    assert sequence_lengths(8, ["a", "b"]) == {"a": 8, "b": 8}
    assert sequence_lengths({"a": 3, "b": 5, "c": 1}, ["a", "b"]) == {"a": 3, "b": 5}
    with pytest.raises(ValueError, match=r"tables \['b'\].*max_seq_len"):
        sequence_lengths({"a": 3}, ["a", "b"])
    with pytest.raises(ValueError, match=r"tables \['a'\].*max_seq_len"):
        sequence_lengths(None, ["a"])
    with pytest.raises(ValueError, match="positive int"):
        sequence_lengths({"a": 0}, ["a"])


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        meta = torch.device("meta")
        self.ebc = EmbeddingBagCollection([EmbeddingBagConfig(name="bag", num_embeddings=100_000, embedding_dim=64,
                                                              feature_names=["b"])], device=meta)
        self.ec = EmbeddingCollection([EmbeddingConfig(name="seq", num_embeddings=100_000, embedding_dim=64,
                                                       feature_names=["s"])], device=meta)


def _sequence_options(max_seq_len):
    topology = torchrec_plugin.topology("v5p", world_size=4)
    planner = torchrec_plugin.planner(topology=topology, batch_size=512)
    model = _Model()
    plan = planner.plan(model, torchrec_plugin.sharders(max_seq_len=max_seq_len))
    return topology, planner, plan


def test_planner_plans_embedding_collections_with_sequence_buffers():
    """An EmbeddingCollection's FUSED shards count the static `[samples, max_seq_len]` block:
    a longer `max_seq_len` costs more HBM, and the plan shards both collections onto tpu."""
    topology, planner, plan = _sequence_options(max_seq_len=32)
    assert set(plan.plan) == {"ebc", "ec"}
    assert all(str(shard.placement.device()).startswith("tpu:") for shard in
               plan.plan["ec"]["seq"].sharding_spec.shards)
    options = [o for o in planner._enumerator.enumerate(_Model(), torchrec_plugin.sharders(max_seq_len=32))
               if o.name == "seq" and o.sharding_type == ShardingType.TABLE_WISE.value]
    short, long = (shard_cost(options[0], options[0].shards[0].size, topology, max_seq_len=n) for n in (8, 64))
    assert 0 < short.hbm < long.hbm and short.activations * 8 == long.activations


def test_planner_asks_for_max_seq_len():
    with pytest.raises(ValueError, match=r"'seq'.*max_seq_len"):
        _sequence_options(max_seq_len=None)
