"""The fused optimizer as TorchRec sees it: FBGEMM's state names and values (row-wise Adagrad also
on tables of 12 and 4 columns, which SparseCore pads to 8-column multiples), state_dict /
load_state_dict round trips (also through CombinedOptimizer), and learning-rate schedulers that
change the rate without recompiling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.fused import FusedOptimizer, FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer

import torchtpu
from _references import (
    LEARNING_RATE,
    OPTIMIZERS,
    FbgemmTraining,
    bag_tables,
    check_bag_training,
    kjt_keys,
    random_kjt,
)
from embeddings import SparseCoreEmbeddingBagCollection

BATCH = 32


def _weights(ebc) -> dict[str, torch.Tensor]:
    return {key.split(".")[1]: value for key, value in ebc.state_dict().items()}


def _train(ebc, reference, rng, steps: int, after_step=None) -> None:
    tables = bag_tables()
    for _ in range(steps):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH)
        grad = torch.from_numpy(rng.standard_normal((BATCH, 48)).astype(np.float32))
        (ebc(kjt).values() * grad.to("tpu")).sum().backward()
        if reference is not None:
            reference.step(kjt, grad)
        if after_step is not None:
            after_step()


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_state_has_fbgemm_names_and_values(optimizer):
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS[optimizer])
    assert isinstance(ebc, FusedOptimizerModule) and isinstance(ebc.fused_optimizer, FusedOptimizer)
    reference = FbgemmTraining(tables, _weights(ebc), optimizer)
    _train(ebc, reference, np.random.default_rng(0), 3)
    state = ebc.fused_optimizer.state_dict()["state"]
    assert list(state) == [f"embedding_bags.t{i}.weight" for i in range(4)]
    fbgemm_state = reference.tbe.get_optimizer_state()
    for i, table in enumerate(tables):
        entries = state[f"embedding_bags.t{i}.weight"]
        assert sorted(entries) == [f"t{i}.momentum1", f"t{i}.step"]
        assert float(entries[f"t{i}.step"]) == 3.0
        expected = fbgemm_state[i]["sum"]
        assert entries[f"t{i}.momentum1"].shape == expected.shape
        torch.testing.assert_close(entries[f"t{i}.momentum1"], expected, rtol=0, atol=1e-5)


def test_row_wise_adagrad_on_tables_narrower_than_the_padded_width_matches_fbgemm():
    """Tables of 12 and 4 columns (padded to 16 and 8 on SparseCore; both 12-wide ones share a
    stack) beside one of 8, under row-wise Adagrad: FBGEMM averages a row's squared gradient over
    the table's own dim, and so does the collection. Outputs at every step, then tables and the
    row-wise state (FBGEMM's `sum`), within 1e-5 after 5 steps."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", num_embeddings=rows, embedding_dim=dim, feature_names=[f"f{i}"])
        for i, (rows, dim) in enumerate(((64, 12), (200, 4), (96, 8), (128, 12)))
    ]
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["rowwise_adagrad"])
    assert ebc.stacks == {"t0_t3": ("t0", "t3"), "t1": ("t1",), "t2": ("t2",)}
    reference = check_bag_training(ebc, ebc, tables, "rowwise_adagrad", 5, BATCH, slice(0, BATCH), seed=7)
    state = ebc.fused_optimizer.state_dict()["state"]
    for table, expected in zip(tables, reference.tbe.get_optimizer_state()):
        got = state[f"embedding_bags.{table.name}.weight"][f"{table.name}.momentum1"]
        assert got.shape == expected["sum"].shape == (table.num_embeddings,)
        torch.testing.assert_close(got, expected["sum"], rtol=0, atol=1e-5, msg=table.name)


def test_adam_state_names():
    ebc = SparseCoreEmbeddingBagCollection(bag_tables()[:1], batch_size=BATCH, optimizer=OPTIMIZERS["adam"])
    entries = ebc.fused_optimizer.state_dict()["state"]["embedding_bags.t0.weight"]
    assert sorted(entries) == ["t0.exp_avg_sq", "t0.momentum1", "t0.step"]
    assert ebc.fused_optimizer.params["embedding_bags.t0.weight"].shape == (64, 8)


def test_load_state_dict_restores_tables_and_optimizer_state_exactly():
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["adam"])
    combined = CombinedOptimizer([("sparse", ebc.fused_optimizer)])
    _train(ebc, None, np.random.default_rng(1), 2)
    saved_tables, saved_optimizer = ebc.state_dict(), combined.state_dict()
    assert "sparse.embedding_bags.t1.weight" in saved_optimizer["state"]
    _train(ebc, None, np.random.default_rng(2), 3)
    first = ebc.state_dict()
    ebc.load_state_dict(saved_tables)
    combined.load_state_dict(saved_optimizer)
    for key, value in combined.state_dict()["state"].items():
        for name, tensor in value.items():
            assert torch.equal(tensor, saved_optimizer["state"][key][name]), name
    _train(ebc, None, np.random.default_rng(2), 3)
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, first[key]), key


def test_lr_scheduler_changes_the_rate_without_recompiling():
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["sgd"])
    reference = FbgemmTraining(tables, _weights(ebc), "sgd")
    scheduler = torch.optim.lr_scheduler.StepLR(ebc.fused_optimizer, step_size=1, gamma=0.5)
    rates = []

    def after_step():
        ebc.fused_optimizer.step()
        scheduler.step()
        rates.append(ebc.fused_optimizer.param_groups[0]["lr"])
        ebc.fused_optimizer.zero_grad()
        reference.tbe.set_learning_rate(rates[-1])

    rng = np.random.default_rng(3)
    _train(ebc, reference, rng, 1, after_step)
    torchtpu.reset_metrics()
    _train(ebc, reference, rng, 4, after_step)
    assert "eager_programs" not in torchtpu.metrics()
    assert rates == [LEARNING_RATE * 0.5**k for k in range(1, 6)]
    trained, expected = _weights(ebc), reference.tables()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=0, atol=1e-5)
    ebc.set_learning_rate(0.125)
    assert ebc.fused_optimizer.param_groups[0]["lr"] == 0.125
    assert ebc.stacked_state.hyperparameter("learning_rate") == 0.125


def test_optimizer_calls_between_forward_and_backward():
    """`zero_grad` / `step` of the fused optimizer between a forward and its backward (a common
    loop order) set the learning rate again: the backward still runs, the same as FBGEMM's; a
    new rate set there takes effect from the next forward."""
    tables = bag_tables()
    ebc = SparseCoreEmbeddingBagCollection(tables, batch_size=BATCH, optimizer=OPTIMIZERS["adagrad"])
    reference = FbgemmTraining(tables, _weights(ebc), "adagrad")
    rng = np.random.default_rng(5)
    for step in range(3):
        kjt = random_kjt(rng, kjt_keys(tables), BATCH)
        grad = torch.from_numpy(rng.standard_normal((BATCH, 48)).astype(np.float32))
        loss = (ebc(kjt).values() * grad.to("tpu")).sum()
        ebc.fused_optimizer.zero_grad()
        ebc.fused_optimizer.step()
        loss.backward()
        reference.step(kjt, grad)
        ebc.set_learning_rate(LEARNING_RATE / 2 ** (step + 1))
        reference.tbe.set_learning_rate(LEARNING_RATE / 2 ** (step + 1))
    trained, expected = _weights(ebc), reference.tables()
    for name in expected:
        torch.testing.assert_close(trained[name], expected[name], rtol=0, atol=1e-5)
    assert ebc.stacked_state.hyperparameter("learning_rate") == float(np.float32(LEARNING_RATE / 8))
