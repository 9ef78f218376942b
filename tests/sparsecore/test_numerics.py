"""End-to-end numerics of the SparseCore kernels against references no one here wrote.

Forward: `torch.nn.EmbeddingBag` (sum, mean, weighted sum) and a NumPy model of the combiners
(sqrtn, weighted mean, sequence). Training, 5 steps of fresh batches with random activation
gradients: FBGEMM's CPU table-batched embedding with fused EXACT_SGD / EXACT_ADAGRAD /
EXACT_ROWWISE_ADAGRAD, `torch.optim.SparseAdam` over `nn.EmbeddingBag(sparse=True)` for Adam, and
the NumPy models of `test_optimizers.py` for AdagradMomentum, FTRL, LaProp and clipping (with a
sequence feature training alongside pooled ones); row-wise Adagrad also on tables of 12 and 4
columns, padded to 16 and 8 in their stacks, against both. Tables and every optimizer slot must
agree within 1e-5; rows no batch touched must not change at all.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsecore import optimizers as opt
from sparsecore.api import SparseCoreEmbedding
from sparsecore.layout import StackGroup, stack_tables
from sparsecore.preprocess import RaggedIds, preprocess
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology
from test_optimizers import numpy_update

STEPS = 5
TOLERANCE = 1e-5


@dataclasses.dataclass
class Setup:
    """An engine over stacked tables, with the inputs of every feature."""

    engine: SparseCoreEmbedding
    features: list[FeatureSpec]
    topology: Topology

    def batch(self, rng: np.random.Generator, weighted: bool = False, max_len: int = 6) -> dict[str, RaggedIds]:
        return {f.name: random_ids(rng, f, weighted, max_len) for f in self.features}

    def packed(self, inputs: dict[str, RaggedIds]):
        return preprocess(tuple(self.engine.stacks.values()), inputs, self.topology)


def make_setup(
    tables: list[TableSpec],
    features: list[FeatureSpec],
    devices: int = 1,
    sparsecores: int = 2,
    stacked: bool = True,
) -> Setup:
    topology = Topology.cpu(devices, sparsecores)
    groups = [StackGroup(tuple(t.name for t in tables))] if stacked else []
    stacks = stack_tables(features, topology, groups)
    return Setup(SparseCoreEmbedding(stacks, topology, entry_chunk=64, row_chunk=32), features, topology)


def random_ids(rng: np.random.Generator, feature: FeatureSpec, weighted: bool, max_len: int) -> RaggedIds:
    """Ragged ids with empty samples and repeats (a few hot ids), optionally weighted."""
    vocab = feature.table.vocabulary_size
    cap = feature.max_sequence_length or max_len
    lengths = rng.integers(0, cap + 1, feature.batch_size)
    hot = rng.integers(0, vocab, 3)
    values = np.where(rng.random(lengths.sum()) < 0.3, rng.choice(hot, lengths.sum()), rng.integers(0, vocab, lengths.sum()))
    weights = rng.uniform(0.25, 2.0, lengths.sum()).astype(np.float32) if weighted else None
    return RaggedIds(values.astype(np.int32), lengths=lengths, weights=weights)


def samples(ids: RaggedIds):
    """(ids, weights) per sample."""
    ends = np.cumsum(ids.lengths)
    weights = ids.weights if ids.weights is not None else np.ones(len(ids.values), np.float32)
    return [(ids.values[e - n : e], weights[e - n : e]) for n, e in zip(ids.lengths, ends)]


def pooled_model(table: np.ndarray, ids: RaggedIds, combiner: str) -> np.ndarray:
    """NumPy model of a pooled lookup: sum_i w_i row_i / divisor (sum: 1, mean: sum w,
    sqrtn: sqrt(sum w^2)); an empty sample gives zeros."""
    out = np.zeros((len(ids.lengths), table.shape[1]))
    for b, (rows, weights) in enumerate(samples(ids)):
        if len(rows) == 0:
            continue
        divisor = {"sum": 1.0, "mean": weights.sum(), "sqrtn": np.sqrt((weights.astype(np.float64) ** 2).sum())}[combiner]
        out[b] = (weights[:, None] * table[rows].astype(np.float64)).sum(0) / divisor
    return out


def row_gradients(table_shape, ids: RaggedIds, grad: np.ndarray, combiner: str) -> tuple[np.ndarray, np.ndarray]:
    """Dense gradient of a pooled lookup w.r.t. the table, and which rows were looked up."""
    dense = np.zeros(table_shape)
    touched = np.zeros(table_shape[0], bool)
    for b, (rows, weights) in enumerate(samples(ids)):
        if len(rows) == 0:
            continue
        divisor = {"sum": 1.0, "mean": weights.sum(), "sqrtn": np.sqrt((weights.astype(np.float64) ** 2).sum())}[combiner]
        np.add.at(dense, rows, (weights[:, None] / divisor) * grad[b][None, :])
        touched[rows] = True
    return dense, touched


# ----------------------------------------------------------------------------- forward

# One engine per device count with a stack per combiner; each feature is checked against its
# reference. Weighted features pass per-id weights, the others none.
FORWARD_TABLES = {
    "sum": [TableSpec("s1", 50, 8, combiner="sum"), TableSpec("s2", 37, 6, combiner="sum")],
    "mean": [TableSpec("m1", 45, 8, combiner="mean"), TableSpec("m2", 20, 8, combiner="mean")],
    "sqrtn": [TableSpec("q1", 64, 16, combiner="sqrtn"), TableSpec("q2", 20, 16, combiner="sqrtn")],
}
FORWARD_FEATURES = {
    # name: (table, weighted, reference)
    "sum": ("s1", False, "torch"),
    "sum_b": ("s2", False, "torch"),
    "sum_weighted": ("s2", True, "torch"),
    "mean": ("m1", False, "torch"),
    "mean_weighted": ("m2", True, "numpy"),
    "sqrtn": ("q1", False, "numpy"),
    "sqrtn_weighted": ("q2", True, "numpy"),
}


@pytest.fixture(scope="module", params=[1, 2], ids=lambda d: f"{d}dev")
def forward_run(request):
    specs = {t.name: t for group in FORWARD_TABLES.values() for t in group}
    features = [FeatureSpec(name, specs[table], 16) for name, (table, _, _) in FORWARD_FEATURES.items()]
    features.append(FeatureSpec("sequence", specs["s1"], 8, max_sequence_length=5))
    topology = Topology.cpu(request.param, 2)
    groups = [StackGroup(tuple(t.name for t in group)) for group in FORWARD_TABLES.values()]
    engine = SparseCoreEmbedding(stack_tables(features, topology, groups), topology, entry_chunk=64, row_chunk=32)
    setup = Setup(engine, features, topology)
    tables, _ = engine.init(jax.random.key(request.param))
    rng = np.random.default_rng(request.param)
    inputs = {f.name: random_ids(rng, f, FORWARD_FEATURES.get(f.name, (None, False))[1], 6) for f in features}
    activations = engine.lookup(tables, setup.packed(inputs))
    return engine.unstack_tables(tables), inputs, {k: np.asarray(v) for k, v in activations.items()}


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in FORWARD_FEATURES.items() if ref == "torch"])
def test_forward_matches_torch_embedding_bag(forward_run, name):
    import torch

    values, inputs, activations = forward_run
    table, _, _ = FORWARD_FEATURES[name]
    mode = "mean" if table.startswith("m") else "sum"
    ids = inputs[name]
    bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(values[table]), mode=mode)
    offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(ids.lengths)[:-1]]).astype(np.int64))
    weights = None if ids.weights is None else torch.from_numpy(ids.weights)
    want = bag(torch.from_numpy(ids.values.astype(np.int64)), offsets, per_sample_weights=weights).numpy()
    np.testing.assert_allclose(activations[name], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in FORWARD_FEATURES.items() if ref == "numpy"])
def test_forward_matches_numpy_combiner_model(forward_run, name):
    values, inputs, activations = forward_run
    table, _, _ = FORWARD_FEATURES[name]
    combiner = {"s": "sum", "m": "mean", "q": "sqrtn"}[table[0]]
    want = pooled_model(values[table], inputs[name], combiner)
    np.testing.assert_allclose(activations[name], want, rtol=1e-5, atol=1e-6)


def test_sequence_feature_returns_every_position_and_zero_padding(forward_run):
    values, inputs, activations = forward_run
    want = np.zeros((8, 5, 8), np.float32)
    for b, (rows, _) in enumerate(samples(inputs["sequence"])):
        want[b, : len(rows)] = values["s1"][rows]
    assert activations["sequence"].shape == (8, 5, 8)
    np.testing.assert_array_equal(activations["sequence"], want)


# ----------------------------------------------------------------------------- training


def random_grads(rng: np.random.Generator, features: list[FeatureSpec]) -> dict[str, np.ndarray]:
    return {f.name: rng.normal(size=f.output_shape).astype(np.float32) for f in features}


def train(setup: Setup, seed: int, weighted: bool = False):
    """Run STEPS updates; return the initial tables, per-step (inputs, grads), and the final tables
    and slots (NumPy). Also checks that rows no step looked up, and their slots, kept their
    initial bits."""
    rng = np.random.default_rng(seed)
    engine = setup.engine
    tables, slots = engine.init(jax.random.key(seed))
    initial = engine.unstack_tables(tables)
    initial_slots = engine.unstack_slots(slots)
    touched = {name: np.zeros(value.shape[0], bool) for name, value in initial.items()}
    history = []
    for _ in range(STEPS):
        inputs = setup.batch(rng, weighted=weighted)
        grads = random_grads(rng, setup.features)
        batch = engine.put_batch(setup.packed(inputs))
        tables, slots = engine.update(tables, slots, batch, {k: jnp.asarray(v) for k, v in grads.items()})
        history.append((inputs, grads))
        for feature in setup.features:
            touched[feature.table.name][inputs[feature.name].values] = True
    final, final_slots = engine.unstack_tables(tables), engine.unstack_slots(slots)
    assert any(not rows.all() for rows in touched.values()), "the check below needs untouched rows"
    for name, rows in touched.items():
        np.testing.assert_array_equal(final[name][~rows].view(np.uint32), initial[name][~rows].view(np.uint32))
        for slot, value in initial_slots.get(name, {}).items():
            np.testing.assert_array_equal(final_slots[name][slot][~rows].view(np.uint32), value[~rows].view(np.uint32))
    return initial, history, final, final_slots


FBGEMM_OPTIMIZERS = [
    # (FBGEMM optimizer, our spec, our slot -> FBGEMM state, devices, combiner)
    ("EXACT_SGD", opt.SGD(learning_rate=0.3), {}, 1, "sum"),
    ("EXACT_ADAGRAD", opt.Adagrad(learning_rate=0.2, epsilon=1e-6), {"accumulator": "sum"}, 2, "mean"),
    ("EXACT_ROWWISE_ADAGRAD", opt.RowWiseAdagrad(learning_rate=0.2, epsilon=1e-6), {"accumulator": "sum"}, 2, "sum"),
]


def fbgemm_training(fbgemm_name: str, spec, combiner: str, tables: list[TableSpec], features: list[FeatureSpec], initial, history):
    """FBGEMM's CPU TBE over `tables` (one feature each, in order) from `initial`, trained on
    `history`: its tables and optimizer states, per table."""
    import torch
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(t.vocabulary_size, t.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in tables],
        optimizer=getattr(EmbOptimType, fbgemm_name),
        learning_rate=spec.learning_rate,
        eps=getattr(spec, "epsilon", 1e-8),
        weight_decay=0.0,
        pooling_mode=PoolingMode.SUM if combiner == "sum" else PoolingMode.MEAN,
    )
    with torch.no_grad():
        for weights, table in zip(tbe.split_embedding_weights(), tables):
            weights.copy_(torch.from_numpy(initial[table.name]))
    for inputs, grads in history:
        ids = [inputs[f.name] for f in features]
        lengths = np.concatenate([x.lengths for x in ids])
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        values = torch.from_numpy(np.concatenate([x.values for x in ids]).astype(np.int64))
        out = tbe(values, offsets)
        out.backward(torch.from_numpy(np.concatenate([grads[f.name] for f in features], axis=1)))
    states = tbe.get_optimizer_state() if fbgemm_name != "EXACT_SGD" else [{} for _ in tables]
    return [w.detach().numpy() for w in tbe.split_embedding_weights()], [{k: v.numpy() for k, v in st.items()} for st in states]


def assert_matches_fbgemm(fbgemm_name, spec, slot_names, combiner, setup: Setup, tables: list[TableSpec], seed: int):
    """Train `setup` STEPS steps and FBGEMM's TBE on the same batches: tables and every slot
    within TOLERANCE."""
    initial, history, got_tables, got_slots = train(setup, seed=seed)
    want_tables, want_states = fbgemm_training(fbgemm_name, spec, combiner, tables, setup.features, initial, history)
    for table, want, state in zip(tables, want_tables, want_states):
        np.testing.assert_allclose(got_tables[table.name], want, rtol=TOLERANCE, atol=TOLERANCE)
        for ours, theirs in slot_names.items():
            np.testing.assert_allclose(
                got_slots[table.name][ours].reshape(state[theirs].shape), state[theirs], rtol=TOLERANCE, atol=TOLERANCE
            )


@pytest.mark.parametrize(
    "fbgemm_name, spec, slot_names, devices, combiner", FBGEMM_OPTIMIZERS, ids=[o[0] for o in FBGEMM_OPTIMIZERS]
)
def test_training_matches_fbgemm_tbe(fbgemm_name, spec, slot_names, devices, combiner):
    tables = [TableSpec("a", 50, 8, combiner=combiner, optimizer=spec), TableSpec("b", 300, 8, combiner=combiner, optimizer=spec)]
    features = [FeatureSpec("fa", tables[0], 16), FeatureSpec("fb", tables[1], 16)]
    assert_matches_fbgemm(fbgemm_name, spec, slot_names, combiner, make_setup(tables, features, devices=devices), tables, 10 + devices)


ROW_WISE = opt.RowWiseAdagrad(learning_rate=0.2, epsilon=1e-6)


def narrow_setup(spec) -> tuple[Setup, list[TableSpec]]:
    """Tables of 12 (a, b: stacked, padded to 16) and 4 (c: padded to 8) columns on 2 devices."""
    tables = [TableSpec(name, vocab, dim, optimizer=spec) for name, vocab, dim in (("a", 50, 12), ("b", 300, 12), ("c", 80, 4))]
    features = [FeatureSpec(f"f{t.name}", t, 16) for t in tables]
    topology = Topology.cpu(2, 2)
    stacks = stack_tables(features, topology, [StackGroup(("a", "b"))])
    assert [(s.embedding_dim, s.logical_embedding_dim) for s in stacks] == [(16, 12), (8, 4)]
    return Setup(SparseCoreEmbedding(stacks, topology, entry_chunk=64, row_chunk=32), features, topology), tables


def test_row_wise_adagrad_on_tables_narrower_than_their_padding_matches_fbgemm_tbe():
    """FBGEMM's EXACT_ROWWISE_ADAGRAD averages a row's squared gradient over the table's own dim;
    so does SparseCore's, whatever the padding of its stack."""
    setup, tables = narrow_setup(ROW_WISE)
    assert_matches_fbgemm("EXACT_ROWWISE_ADAGRAD", ROW_WISE, {"accumulator": "sum"}, "sum", setup, tables, seed=40)


def test_adam_matches_torch_sparse_adam():
    import torch

    spec = opt.Adam(learning_rate=0.05, beta1=0.8, beta2=0.95, epsilon=1e-6)
    tables = [TableSpec("a", 50, 8, optimizer=spec), TableSpec("b", 300, 8, optimizer=spec)]
    features = [FeatureSpec("fa", tables[0], 16), FeatureSpec("fb", tables[1], 16)]
    setup = make_setup(tables, features, devices=2)
    initial, history, got_tables, got_slots = train(setup, seed=20, weighted=True)

    bags = {t.name: torch.nn.EmbeddingBag(t.vocabulary_size, t.embedding_dim, mode="sum", sparse=True) for t in tables}
    with torch.no_grad():
        for name, bag in bags.items():
            bag.weight.copy_(torch.from_numpy(initial[name]))
    adam = torch.optim.SparseAdam([b.weight for b in bags.values()], lr=spec.learning_rate, betas=(spec.beta1, spec.beta2), eps=spec.epsilon)
    for inputs, grads in history:
        adam.zero_grad()
        for feature in features:
            ids = inputs[feature.name]
            offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(ids.lengths)[:-1]]).astype(np.int64))
            out = bags[feature.table.name](
                torch.from_numpy(ids.values.astype(np.int64)), offsets, per_sample_weights=torch.from_numpy(ids.weights)
            )
            out.backward(torch.from_numpy(grads[feature.name]))
        adam.step()
    for name, bag in bags.items():
        state = adam.state[bag.weight]
        np.testing.assert_allclose(got_tables[name], bag.weight.detach().numpy(), rtol=TOLERANCE, atol=TOLERANCE)
        np.testing.assert_allclose(got_slots[name]["momentum"], state["exp_avg"].numpy(), rtol=TOLERANCE, atol=TOLERANCE)
        np.testing.assert_allclose(got_slots[name]["velocity"], state["exp_avg_sq"].numpy(), rtol=TOLERANCE, atol=TOLERANCE)


def numpy_training(spec, setup: Setup, initial, history):
    """The NumPy models of `test_optimizers` over the same steps: each step, every table's
    looked-up rows get one update from their summed gradient; other rows and slots stay."""
    tables = {name: value.astype(np.float64) for name, value in initial.items()}
    slots = {
        name: {s.name: np.full((value.shape[0], s.width(value.shape[1])), s.initial_value) for s in spec.slots()}
        for name, value in initial.items()
    }
    for step, (inputs, grads) in enumerate(history, start=1):
        dense = {name: np.zeros_like(value) for name, value in tables.items()}
        touched = {name: np.zeros(value.shape[0], bool) for name, value in tables.items()}
        for feature in setup.features:
            name = feature.table.name
            ids, grad, combiner = inputs[feature.name], grads[feature.name], feature.table.combiner.value
            if feature.is_sequence:
                # Every position is its own output row, its weight its gain (no combiner).
                positions = np.concatenate([np.arange(n) for n in ids.lengths]).astype(int)
                grad = grad[np.repeat(np.arange(len(ids.lengths)), ids.lengths), positions]
                ids, combiner = RaggedIds(ids.values, lengths=np.ones(len(ids.values), int), weights=ids.weights), "sum"
            g, t = row_gradients(tables[name].shape, ids, grad, combiner)
            dense[name] += g
            touched[name] |= t
        for name in tables:
            rows = touched[name]
            new_row, new_slots = numpy_update(spec, dense[name][rows], tables[name][rows], {k: v[rows] for k, v in slots[name].items()}, float(step))
            tables[name][rows] = new_row
            for key, value in new_slots.items():
                slots[name][key][rows] = value
    return tables, slots


NUMPY_OPTIMIZERS = [
    opt.AdagradMomentum(learning_rate=0.1, momentum=0.6, beta2=0.95, use_nesterov=True),
    opt.FTRL(learning_rate=0.5, l1_regularization_strength=0.001, l2_regularization_strength=0.01, beta=0.1),
    opt.LaProp(learning_rate=0.02, b1=0.8, decay_rate=0.9, epsilon=1e-10),
    opt.RowWiseAdagrad(learning_rate=0.2, clip_gradient=0.4),
]


@pytest.mark.parametrize("spec", [ROW_WISE, opt.RowWiseAdagrad(learning_rate=0.2, clip_gradient=0.4)], ids=["plain", "clipped"])
def test_row_wise_adagrad_on_tables_narrower_than_their_padding_matches_numpy_model(spec):
    setup, _ = narrow_setup(spec)
    initial, history, got_tables, got_slots = train(setup, seed=41)
    want_tables, want_slots = numpy_training(spec, setup, initial, history)
    for name in want_tables:
        np.testing.assert_allclose(got_tables[name], want_tables[name], rtol=TOLERANCE, atol=TOLERANCE)
        np.testing.assert_allclose(got_slots[name]["accumulator"], want_slots[name]["accumulator"], rtol=TOLERANCE, atol=TOLERANCE)


@pytest.mark.parametrize("spec", NUMPY_OPTIMIZERS, ids=lambda s: type(s).__name__ + ("_clipped" if s.clip_gradient else ""))
def test_training_matches_numpy_model(spec):
    tables = [TableSpec("a", 50, 8, combiner="mean", optimizer=spec), TableSpec("b", 300, 8, combiner="mean", optimizer=spec)]
    features = [
        FeatureSpec("fa", tables[0], 16),
        FeatureSpec("fb", tables[1], 16),
        FeatureSpec("fa2", tables[0], 16),
        FeatureSpec("sequence", tables[1], 8, max_sequence_length=4),
    ]
    setup = make_setup(tables, features, devices=2)
    initial, history, got_tables, got_slots = train(setup, seed=30, weighted=True)
    want_tables, want_slots = numpy_training(spec, setup, initial, history)
    for name in want_tables:
        np.testing.assert_allclose(got_tables[name], want_tables[name], rtol=TOLERANCE, atol=TOLERANCE)
        for key, value in want_slots[name].items():
            np.testing.assert_allclose(got_slots[name][key], value, rtol=TOLERANCE, atol=TOLERANCE)
