"""SparseCoreEmbeddingConfig: TorchRec configs with SparseCore limits, validated where written,
translated to sparsecore specs with TorchRec's initialisation bounds and naming."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig, PoolingType

from embeddings.config import SparseCoreEmbeddingConfig, as_sparsecore_config, embedding_names
from sparsecore.optimizers import Adagrad
from sparsecore.spec import Combiner, NamedInitializer


def bag(**kwargs) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(**{"name": "t", "num_embeddings": 100, "embedding_dim": 8, **kwargs})


def test_table_spec_carries_limits_combiner_and_torchrec_bounds():
    config = SparseCoreEmbeddingConfig(
        bag(pooling=PoolingType.MEAN, weight_init_min=-0.5, weight_init_max=0.25),
        max_ids_per_partition=64,
        max_unique_ids_per_partition=32,
        suggested_coo_buffer_size_per_device=1024,
    )
    spec = config.table_spec(Adagrad(learning_rate=0.3))
    assert (spec.name, spec.vocabulary_size, spec.embedding_dim) == ("t", 100, 8)
    assert spec.combiner is Combiner.MEAN and spec.optimizer == Adagrad(learning_rate=0.3)
    assert spec.initializer == NamedInitializer("uniform", (-0.5, 0.25))
    assert (spec.max_ids_per_partition, spec.max_unique_ids_per_partition) == (64, 32)
    assert spec.suggested_coo_buffer_size_per_device == 1024
    assert config.host_initializer is None
    default = as_sparsecore_config(bag()).table_spec(Adagrad())
    assert default.initializer == NamedInitializer("uniform", (-0.1, 0.1))


def test_custom_init_fn_is_a_host_initializer():
    def init(weight: torch.Tensor) -> None:
        torch.nn.init.normal_(weight)

    assert as_sparsecore_config(bag(init_fn=init)).host_initializer is init


def test_unpooled_tables_need_max_seq_len_and_pooled_ones_refuse_it():
    sequence = EmbeddingConfig(name="s", num_embeddings=10, embedding_dim=8)
    with pytest.raises(ValueError, match="table 's': an unpooled table needs max_seq_len"):
        SparseCoreEmbeddingConfig(sequence)
    feature = SparseCoreEmbeddingConfig(sequence, max_seq_len=7).feature_specs(
        as_sparsecore_config(bag()).table_spec(Adagrad()), ("s",), 32
    )[0]
    assert feature.output_shape == (32, 7, 8)
    with pytest.raises(ValueError, match="table 't': max_seq_len is for unpooled tables"):
        SparseCoreEmbeddingConfig(bag(), max_seq_len=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"data_type": DataType.FP16}, "table 't': SparseCore tables are float32"),
        ({"pooling": PoolingType.NONE}, "table 't': pooling PoolingType.NONE is not supported"),
        ({"name": ""}, "needs a name"),
    ],
)
def test_bad_configs_raise_naming_the_table(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SparseCoreEmbeddingConfig(bag(**kwargs))


def test_limits_are_checked_by_the_spec():
    with pytest.raises(ValueError, match="max_ids_per_partition must be a positive int, got 0"):
        SparseCoreEmbeddingConfig(bag(), max_ids_per_partition=0).table_spec(Adagrad())


def test_feature_names_default_to_the_table_and_shared_features_get_table_suffixes():
    a = as_sparsecore_config(bag(name="a", feature_names=["u", "v"]))
    b = as_sparsecore_config(bag(name="b", feature_names=["u"]))
    c = as_sparsecore_config(bag(name="c"))
    assert c.feature_names == ("c",)
    assert embedding_names([a, b, c]) == [("u@a", "v"), ("u@b",), ("c",)]
