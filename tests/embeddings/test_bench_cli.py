"""`torchtpu-embedding-bench` end to end on a tiny workload (every system, a sweep with JSON, CSV
and a PNG plot), its option errors, its correctness gate and its id generator."""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from embeddings.bench import cli
from embeddings.bench.measure import SystemResult
from embeddings.bench.options import BenchConfig, parse
from embeddings.bench.runner import SYSTEMS, OutputMismatchError, check_outputs
from embeddings.bench.workload import make_workload

REPO = Path(__file__).resolve().parents[2]
TINY = ["--tables", "2", "--rows", "300,1000", "--dim", "8", "--ids-per-bag", "uniform:1:6", "--combiner", "mean",
        "--devices", "2", "--warmup", "1", "--iterations", "2", "--seed", "3"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_cli_end_to_end_sweep_json_csv_plot(tmp_path):
    """A learning-rate sweep: the rate is a runtime input, so the second point reuses most of the
    first one's programs and the test stays short."""
    out = {kind: tmp_path / f"bench.{kind}" for kind in ("json", "csv", "png")}
    argv = [*TINY, "--batch-size", "32", "--sweep", "learning-rate=0.01,0.05", "--json", str(out["json"]), "--csv", str(out["csv"]),
            "--plot", str(out["png"]), "--no-progress"]
    done = _run_cli(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    for system in SYSTEMS:
        assert system in done.stdout

    document = json.loads(out["json"].read_text())
    assert document["sweep"] == {"key": "learning-rate", "values": ["0.01", "0.05"]}
    assert [p["sweep_value"] for p in document["points"]] == ["0.01", "0.05"]
    fields = {f.name for f in dataclasses.fields(SystemResult)}
    for point, learning_rate in zip(document["points"], (0.01, 0.05)):
        config = parse([*TINY, "--batch-size", "32"]).configs[0]
        assert point["config"]["learning_rate"] == learning_rate and point["config"]["batch_size"] == 32
        assert set(point["config"]) == {f.name for f in dataclasses.fields(BenchConfig)}
        assert point["lookups_per_step"] == make_workload(config).mean_lookups
        assert point["gather_gb_per_s"] > 0 and point["load_average"] >= 0
        systems = {s["system"]: s for s in point["systems"]}
        assert set(systems) == set(SYSTEMS)
        for name, result in systems.items():
            assert set(result) == fields, name
            for key, value in result.items():
                assert key == "system" or (isinstance(value, (int, float)) and math.isfinite(value)), (name, key)
            assert 0 < result["p50_ms"] <= result["p90_ms"]
            assert result["lookups_per_s"] == pytest.approx(point["lookups_per_step"] / result["p50_ms"] * 1e3)
            assert result["gb_per_s"] == pytest.approx(result["lookups_per_s"] * 8 * 4 / 1e9)
            assert result["gather_share"] == pytest.approx(result["gb_per_s"] / point["gather_gb_per_s"])
            assert result["vs_fbgemm"] == pytest.approx(result["p50_ms"] / systems["fbgemm"]["p50_ms"])
        assert 0 < systems["tpu"]["host_share"] < 1
        assert systems["tpu"]["measured_compiles"] == 0
        for name in SYSTEMS[1:]:
            assert systems[name]["compiles"] == 0 and systems[name]["host_share"] == 0

    first, second = ({s["system"]: s for s in p["systems"]}["tpu"] for p in document["points"])
    assert first["compiles"] > 0 and first["compile_s"] > 0
    assert second["compiles"] < first["compiles"]

    with out["csv"].open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["sweep_value"], r["system"]) for r in rows] == [(v, s) for v in ("0.01", "0.05") for s in SYSTEMS]

    png = out["png"].read_bytes()
    assert png.startswith(PNG_SIGNATURE)
    from matplotlib import image

    height, width, _ = image.imread(out["png"]).shape
    assert height > 100 and width > 100


@pytest.mark.slow
def test_cli_two_processes(tmp_path):
    """Two spawned stand-in hosts of one device each: one mesh, process 0 reports."""
    path = tmp_path / "bench.json"
    argv = [*TINY, "--devices", "1", "--processes", "2", "--batch-size", "32", "--json", str(path), "--no-progress"]
    done = _run_cli(argv, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (point,) = json.loads(path.read_text())["points"]
    assert point["config"]["processes"] == 2
    assert [s["system"] for s in point["systems"]] == list(SYSTEMS)
    assert point["lookups_per_step"] == make_workload(parse(argv).configs[0]).mean_lookups


def _run_cli(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHTPU_LOCK_DIR": str(tmp_path / "locks")}
    return subprocess.run([sys.executable, "-m", "embeddings.bench.cli", *argv], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


def test_console_script_is_the_cli():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts["torchtpu-embedding-bench"] == "embeddings.bench.cli:main"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dim", "12"], "--dim 12: SparseCore rows are a multiple of 8 floats; use a multiple of 8 (e.g. 8 or 16)"),
        (["--rows", "100,20", "--tables", "2", "--ids-per-bag", "30"],
         "table t1 has only 20 rows; lower --ids-per-bag to at most 20 or raise --rows"),
        (["--ids-per-bag", "uniform:5:50", "--rows", "40"], "up to 50 distinct ids"),
        (["--optimizer", "adam"], "--optimizer 'adam' is unknown here; use one of sgd, adagrad, rowwise_adagrad"),
        (["--sharding", "row_wise"], "use --sharding mod"),
        (["--sharding", "diagonal"], "--sharding 'diagonal' is unknown"),
        (["--batch-size", "100", "--devices", "2"], "use a multiple of 8 (e.g. 96)"),
        (["--rows", "10,20,30", "--tables", "2"], "3 counts for 2 tables"),
        (["--id-distribution", "zipf:-1"], "expected 'uniform' or 'zipf:ALPHA' with ALPHA > 0"),
        (["--ids-per-bag", "many"], "expected a count (20) or a range uniform:LOW:HIGH"),
        (["--sweep", "devices=1,2"], "devices cannot be swept (the device count is fixed when jax starts)"),
        (["--sweep", "colour=1,2"], "unknown option 'colour'"),
        (["--sweep", "dim=8,12"], "--dim 12: SparseCore rows are a multiple of 8"),
        (["--plot", "out.png"], "--plot draws throughput against a swept option: add --sweep"),
        (["--combiner", "max"], "invalid choice: 'max'"),
        (["--frobnicate"], "unrecognised arguments: --frobnicate"),
    ],
)
def test_bad_options_exit_2_saying_what_to_change(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_BAD_OPTION
    err = capsys.readouterr().err
    assert err.startswith("torchtpu-embedding-bench: error: ")
    assert message in err


def test_output_check_names_the_first_wrong_value():
    rng = np.random.default_rng(0)
    reference = torch.from_numpy(rng.uniform(-0.05, 0.05, (16, 24)).astype(np.float32))
    reordered = (reference.double() + 1e-9).float()  # another summation order: within tolerance
    check_outputs(reference, {"tpu": reordered, "torchrec": reference.clone()}, dim=8)
    wrong = reference.clone()
    wrong[5, 19] += 0.003  # one row's worth of difference in table t2, column 3
    with pytest.raises(OutputMismatchError, match=r"tpu's pooled output .* 1 of 384 values, first at sample 5, "
                                                  r"table t2 column 3"):
        check_outputs(reference, {"tpu": wrong}, dim=8)
    with pytest.raises(OutputMismatchError, match=r"shape \(8, 24\), FBGEMM's \(16, 24\)"):
        check_outputs(reference, {"embedding_bag": reference[:8]}, dim=8)


@pytest.mark.parametrize("distribution", ["uniform", "zipf:1.2"])
def test_batches_have_distinct_ids_per_bag_within_bounds(distribution):
    argv = ["--tables", "3", "--rows", "12,500,40", "--ids-per-bag", "uniform:0:12", "--batch-size", "64",
            "--id-distribution", distribution]
    config = parse(argv).configs[0]
    workload = make_workload(config)
    counts = np.zeros(500)
    for batch in workload.batches:
        assert batch.output_grad.shape == (64, 3 * 64)
        for rows, lengths, ids in zip(config.rows, batch.lengths, batch.ids):
            assert lengths.min() >= 0 and lengths.max() <= 12 and ids.size == lengths.sum()
            assert ids.min() >= 0 and ids.max() < rows
            for bag in np.split(ids, np.cumsum(lengths)[:-1]):
                assert len(np.unique(bag)) == len(bag)
        counts += np.bincount(batch.ids[1], minlength=500)
    top_share = np.sort(counts)[-25:].sum() / counts.sum()  # the 5% most frequent rows of t1
    assert top_share > 0.3 if distribution.startswith("zipf") else top_share < 0.15
