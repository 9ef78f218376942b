"""Host preprocessing of KJTs: bad input raises naming the feature or table and the observed vs
configured values; drops happen only when allowed, and are counted; limits grow only when
allowed, and training across a growth still matches FBGEMM; a batch preprocessed ahead gives the
same lookup as the KJT."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchtpu
from _references import OPTIMIZERS, bag_tables, check_bag_training, kjt_keys, random_kjt
from embeddings import (
    SparseCoreBatch,
    SparseCoreEmbeddingBagCollection,
    SparseCoreEmbeddingCollection,
    SparseCoreEmbeddingConfig,
)
from embeddings.ops import BUFFERS
from sparsecore.preprocess import PartitionLimitError

BATCH = 32


@pytest.fixture(scope="module")
def ebc():
    return SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH)


def test_prepared_batch_is_sharded_buffers_and_gives_the_same_lookup(ebc):
    kjt = random_kjt(np.random.default_rng(0), kjt_keys(bag_tables()), BATCH)
    batch = ebc.prepare(kjt)
    assert isinstance(batch, SparseCoreBatch) and set(batch.buffers) == set(ebc.stacks)
    for buffers in batch.buffers.values():
        assert len(buffers) == len(BUFFERS)
        assert all(t.device.type == "tpu" and t.shape[0] == 4 for t in buffers)
    assert batch.dropped_ids == 0
    assert torch.equal(ebc(batch).values().cpu(), ebc(kjt).values().cpu())


def test_kjt_keys_must_match_the_features(ebc):
    rng = np.random.default_rng(1)
    keys = kjt_keys(bag_tables())
    with pytest.raises(ValueError, match=r"missing \['f3'\], unexpected \['zz'\]"):
        ebc(random_kjt(rng, keys[:3] + [("zz", 10)], BATCH))


def test_batch_size_must_match(ebc):
    kjt = random_kjt(np.random.default_rng(2), kjt_keys(bag_tables()), 16)
    with pytest.raises(ValueError, match="holds 16 samples, but the module was built for a batch of 32 per process"):
        ebc(kjt)


def test_ids_out_of_range_name_the_feature_and_table(ebc):
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1", "f2", "f3"],
        values=torch.tensor([3, 200, 1, 2]),
        lengths=torch.tensor([1] + [0] * 31 + [1] + [0] * 31 + [1] + [0] * 31 + [1] + [0] * 31),
    )
    message = r"feature 'f1': id 200 \(position 0\) is outside the vocabulary \[0, 200\) of table 't1'"
    with pytest.raises(ValueError, match=message):
        ebc(kjt)


def test_weighted_module_needs_weights():
    ebc = SparseCoreEmbeddingBagCollection(bag_tables()[:1], batch_size=BATCH, is_weighted=True)
    with pytest.raises(ValueError, match="is weighted.*has no weights"):
        ebc(random_kjt(np.random.default_rng(3), kjt_keys(bag_tables()[:1]), BATCH))


def _hot_kjt() -> KeyedJaggedTensor:
    """Every sample reads the same 8 rows of one MOD shard (rows 0, 16, ..., 112 of 16
    SparseCores): each SparseCore sends 2 samples x 8 rows = 16 ids to that partition."""
    return KeyedJaggedTensor(
        keys=["f"], values=torch.arange(0, 128, 16).repeat(BATCH), lengths=torch.full((BATCH,), 8),
    )


def test_partition_limit_raises_or_drops_and_counts():
    table = EmbeddingBagConfig(name="t", num_embeddings=256, embedding_dim=8, feature_names=["f"])
    config = SparseCoreEmbeddingConfig(table, max_ids_per_partition=8, max_unique_ids_per_partition=8)
    strict = SparseCoreEmbeddingBagCollection([config], batch_size=BATCH)
    with pytest.raises(PartitionLimitError, match="max_ids_per_partition") as error:
        strict(_hot_kjt())
    assert "16" in str(error.value) and "'t'" in str(error.value)
    dropping = SparseCoreEmbeddingBagCollection([config], batch_size=BATCH, allow_id_dropping=True)
    batch = dropping.prepare(_hot_kjt())
    assert batch.dropped_ids > 0 and dropping.dropped_ids == batch.dropped_ids
    observed = max(int(stats.max_ids_per_partition.max()) for stats in batch.stats.values())
    assert observed == 16 and batch.dropped_ids == 16 * (16 - 8)
    out = dropping(batch).values()
    assert out.shape == (BATCH, 8)


def test_sequences_longer_than_max_seq_len_are_rejected():
    table = EmbeddingConfig(name="s", num_embeddings=32, embedding_dim=8, feature_names=["q"])
    ec = SparseCoreEmbeddingCollection([SparseCoreEmbeddingConfig(table, max_seq_len=3)], batch_size=BATCH)
    kjt = KeyedJaggedTensor(keys=["q"], values=torch.zeros(4, dtype=torch.int64),
                            lengths=torch.tensor([4] + [0] * (BATCH - 1)))
    with pytest.raises(ValueError, match="feature 'q': sample 0 has 4 ids, more than its max_sequence_length 3"):
        ec(kjt)


def test_forward_rejects_other_inputs(ebc):
    with pytest.raises(TypeError, match="expected a KeyedJaggedTensor or a SparseCoreBatch, got dict"):
        ebc({"f0": torch.zeros(1)})


def _tight(tables: list[EmbeddingBagConfig]) -> list[SparseCoreEmbeddingConfig]:
    return [SparseCoreEmbeddingConfig(t, max_ids_per_partition=1, max_unique_ids_per_partition=1) for t in tables]


def test_limit_growth_keeps_training_equal_to_fbgemm():
    """Limits of one id per partition: the first batch grows them (a new layout) and training goes
    on from the same tables and optimizer state, as FBGEMM's over the same 5 steps."""
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(_tight(tables), batch_size=BATCH, optimizer=OPTIMIZERS["adagrad"],
                                           limit_growth=1.5)
    before = ebc.limits()
    torchtpu.reset_metrics()
    check_bag_training(ebc, ebc, tables, "adagrad", 5, BATCH, slice(0, BATCH), seed=5)
    assert ebc.limit_growths >= 1 and torchtpu.metrics()["sparsecore_limit_growths"] == ebc.limit_growths
    assert all(ebc.limits()[stack][0] > before[stack][0] for stack in before)
    assert ebc.dropped_ids == 0


def _lookup_reference(ebc: SparseCoreEmbeddingBagCollection, tables) -> EmbeddingBagCollection:
    reference = EmbeddingBagCollection(tables)
    reference.load_state_dict(ebc.state_dict())
    return reference


def test_prepare_defers_a_batch_over_the_limits_and_stale_batches_are_prepared_again():
    table = EmbeddingBagConfig(name="t", num_embeddings=256, embedding_dim=8, feature_names=["f"])
    config = SparseCoreEmbeddingConfig(table, max_ids_per_partition=8, max_unique_ids_per_partition=8)
    ebc = SparseCoreEmbeddingBagCollection([config], batch_size=BATCH, limit_growth=2.0)
    reference = _lookup_reference(ebc, [table])
    light = KeyedJaggedTensor(keys=["f"], values=torch.arange(BATCH), lengths=torch.ones(BATCH, dtype=torch.int64))
    stale = ebc.prepare(light)
    hot = _hot_kjt()
    deferred = ebc.prepare(hot)
    assert deferred.layout is None and deferred.source is hot
    assert ebc.limit_growths == 0, "prepare (a loader's thread) never changes the module"
    torch.testing.assert_close(ebc(deferred).values().cpu(), reference(hot).values(), rtol=0, atol=1e-6)
    assert ebc.limit_growths == 1
    torch.testing.assert_close(ebc(stale).values().cpu(), reference(light).values(), rtol=0, atol=1e-6)
    assert ebc.limit_growths == 1 and ebc.prepare(_hot_kjt()).layout is not None


def test_limit_growth_settings_are_checked():
    with pytest.raises(ValueError, match="limit_growth must be a margin >= 1.0"):
        SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, limit_growth=0.5)
    with pytest.raises(ValueError, match="limit_growth and allow_id_dropping exclude each other"):
        SparseCoreEmbeddingBagCollection(bag_tables(), batch_size=BATCH, limit_growth=1.5, allow_id_dropping=True)
