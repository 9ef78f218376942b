"""The benchmark's options: the command line, parsed and checked into one `BenchConfig`.

Everything a run needs is checked here, before jax or torch start, so a bad option costs no
time and its message says what to change. A sweep (`--sweep KEY=v1,v2`) re-parses the command
line with `--KEY v` appended for each value, so swept values go through exactly the checks a
plain option does.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BagLengths",
    "BenchConfig",
    "BenchOptionError",
    "IdDistribution",
    "Invocation",
    "OPTIMIZERS",
    "PLUGIN_SHARDING_TYPES",
    "Sweep",
    "parse",
    "parser",
]

OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
"""The fused optimizers every system has: FBGEMM's CPU TBE fuses only these (no Adam on CPU)."""

PLUGIN_SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
"""TorchRec's sharding types, which only the TorchRec plugin (`torchrec_plugin.sharders`) offers."""

EAGER_MODES = ("strict", "defer", "compiled")
_NOT_SWEEPABLE = ("devices", "processes", "json", "csv", "plot", "sweep", "no-progress")


class BenchOptionError(ValueError):
    """An option the benchmark cannot run with; the message says what to change."""


@dataclass(frozen=True)
class BagLengths:
    """Ids per bag: every bag `low` when `low == high`, else uniform integers in [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> BagLengths:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                low = high = int(parts[0])
            elif len(parts) == 3 and parts[0] == "uniform":
                low, high = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise BenchOptionError(
                f"--ids-per-bag {text!r}: expected a count (20) or a range uniform:LOW:HIGH (uniform:1:40)"
            ) from None
        if not 0 <= low <= high or high == 0:
            raise BenchOptionError(
                f"--ids-per-bag {text!r}: need 0 <= LOW <= HIGH and HIGH >= 1 (got LOW={low}, HIGH={high})"
            )
        return cls(low, high)

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"uniform:{self.low}:{self.high}"


@dataclass(frozen=True)
class IdDistribution:
    """Which rows a bag's ids hit: `uniform`, or `zipf` with P(rank k) ~ (k + 1)^-alpha (ranks
    hashed to ids by a fixed permutation, as real ids are)."""

    kind: str
    alpha: float = 0.0

    @classmethod
    def parse(cls, text: str) -> IdDistribution:
        if text == "uniform":
            return cls("uniform")
        kind, _, value = text.partition(":")
        if kind == "zipf":
            try:
                alpha = float(value)
            except ValueError:
                alpha = math.nan
            if alpha > 0 and math.isfinite(alpha):
                return cls("zipf", alpha)
        raise BenchOptionError(
            f"--id-distribution {text!r}: expected 'uniform' or 'zipf:ALPHA' with ALPHA > 0 (zipf:1.05)"
        )

    def __str__(self) -> str:
        return self.kind if self.kind == "uniform" else f"zipf:{self.alpha:g}"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark point: the workload, the SparseCore layout and how it is timed."""

    tables: int
    rows: tuple[int, ...]
    dim: int
    batch_size: int
    ids_per_bag: BagLengths
    id_distribution: IdDistribution
    combiner: str
    optimizer: str
    learning_rate: float
    training: bool
    sharding: str
    sparsecores_per_device: int
    stacking: str
    devices: int
    processes: int
    eager_mode: str
    warmup: int
    iterations: int
    seed: int

    @property
    def lookups_per_batch(self) -> float:
        """Expected ids per global batch over all tables."""
        return self.tables * self.batch_size * self.ids_per_bag.mean

    @property
    def num_sparsecores(self) -> int:
        return self.processes * self.devices * self.sparsecores_per_device

    def describe(self) -> str:
        rows = self.rows[0] if len(set(self.rows)) == 1 else list(self.rows)
        return (
            f"{self.tables} tables x {rows} rows x dim {self.dim}, batch {self.batch_size}, "
            f"{self.ids_per_bag} ids/bag ({self.id_distribution}), {self.combiner} pooling, "
            f"{'training with fused ' + self.optimizer if self.training else 'forward only'}; tpu: "
            f"{self.processes} process(es) x {self.devices} stand-in device(s) x {self.sparsecores_per_device} "
            f"SparseCores, {self.sharding.upper()} sharding, stacking {self.stacking}, {self.eager_mode} mode; "
            f"{self.warmup} warm-up + {self.iterations} measured steps, seed {self.seed}"
        )


@dataclass(frozen=True)
class Sweep:
    """`--sweep KEY=v1,v2,...`: the option swept and its values, as typed."""

    key: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Invocation:
    """A parsed command line: one config per sweep point (one without a sweep), and the outputs."""

    configs: tuple[BenchConfig, ...]
    sweep: Sweep | None
    json_path: str | None
    csv_path: str | None
    plot_path: str | None
    progress: bool


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchtpu-embedding-bench",
        description="Time SparseCore embedding tables on tpu against FBGEMM, torch.nn.EmbeddingBag and "
        "TorchRec on CPU, on the same ids, and compare with this machine's random-row gather bandwidth.",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--tables", type=int, default=8, help="number of tables (one feature each)")
    w.add_argument("--rows", default="100000", help="rows per table: one count, or one per table (a,b,...)")
    w.add_argument("--dim", type=int, default=64, help="embedding dim (a multiple of 8)")
    w.add_argument("--batch-size", type=int, default=2048, help="global batch (samples per step)")
    w.add_argument("--ids-per-bag", default="20", help="a count, or uniform:LOW:HIGH; ids in a bag are distinct")
    w.add_argument("--id-distribution", default="zipf:1.05", help="uniform, or zipf:ALPHA")
    w.add_argument("--combiner", choices=("sum", "mean"), default="sum")
    w.add_argument("--optimizer", default="rowwise_adagrad", help=f"fused optimizer: one of {', '.join(OPTIMIZERS)}")
    w.add_argument("--learning-rate", type=float, default=0.01)
    w.add_argument("--mode", choices=("training", "forward"), default="training",
                   help="training: forward + backward + fused update; forward: lookups only")
    t = p.add_argument_group("SparseCore layout and tpu runtime")
    t.add_argument("--sharding", default="mod", help="mod (the SparseCore collections' MOD layout), or a "
                   "TorchRec sharding type when the TorchRec plugin provides it")
    t.add_argument("--sparsecores-per-device", type=int, default=4)
    t.add_argument("--stacking", choices=("auto", "none"), default="auto", help="MOD table stacking")
    t.add_argument("--devices", type=int, default=1, help="stand-in devices per process")
    t.add_argument("--processes", type=int, default=1, help="processes (stand-in hosts), each with --devices")
    t.add_argument("--eager-mode", choices=EAGER_MODES, default="strict")
    r = p.add_argument_group("run")
    r.add_argument("--warmup", type=int, default=3, help="untimed steps per system (compiles happen here)")
    r.add_argument("--iterations", type=int, default=20, help="measured steps per system")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--sweep", metavar="KEY=v1,v2,...", help="run once per value of one option (e.g. batch-size=512,2048)")
    r.add_argument("--json", metavar="FILE", help="write every result as JSON")
    r.add_argument("--csv", metavar="FILE", help="write every result as CSV")
    r.add_argument("--plot", metavar="FILE.png", help="with --sweep: lookups/s against the swept value")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def parse(argv: Sequence[str]) -> Invocation:
    """Parse and check a command line; raise `BenchOptionError` saying what to change."""
    p = parser()
    args = _parse_args(p, argv)
    sweep = _sweep(args.sweep, p)
    if args.plot is not None and sweep is None:
        raise BenchOptionError("--plot draws throughput against a swept option: add --sweep KEY=v1,v2,...")
    if args.plot is not None and not args.plot.endswith(".png"):
        raise BenchOptionError(f"--plot {args.plot!r}: the plot is a PNG file; name it FILE.png")
    if sweep is None:
        configs = (_config(args),)
    else:
        configs = tuple(_config(_parse_args(p, [*argv, f"--{sweep.key}", value])) for value in sweep.values)
    return Invocation(configs, sweep, args.json, args.csv, args.plot, not args.no_progress)


def _parse_args(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """argparse, with its errors raised as `BenchOptionError` instead of exiting."""
    p.exit_on_error = False
    try:
        args, unknown = p.parse_known_args(list(argv))
    except argparse.ArgumentError as error:
        raise BenchOptionError(str(error)) from None
    if unknown:
        raise BenchOptionError(f"unrecognised arguments: {' '.join(unknown)} (see --help)")
    return args


def _sweep(text: str | None, p: argparse.ArgumentParser) -> Sweep | None:
    if text is None:
        return None
    key, _, values = text.partition("=")
    options = {dest.replace("_", "-") for dest in vars(p.parse_args([]))}
    sweepable = sorted(options - set(_NOT_SWEEPABLE))
    if key not in options:
        raise BenchOptionError(f"--sweep {text!r}: unknown option {key!r}; sweepable: {', '.join(sweepable)}")
    if key in _NOT_SWEEPABLE:
        reason = " (the device count is fixed when jax starts)" if key in ("devices", "processes") else ""
        raise BenchOptionError(f"--sweep {text!r}: {key} cannot be swept{reason}; sweepable: {', '.join(sweepable)}")
    swept = tuple(v for v in values.split(",") if v)
    if len(swept) < 2:
        raise BenchOptionError(f"--sweep {text!r}: give at least two values, KEY=v1,v2,...")
    return Sweep(key, swept)


def _config(args: argparse.Namespace) -> BenchConfig:
    _at_least(1, tables=args.tables, batch_size=args.batch_size, devices=args.devices, processes=args.processes,
              sparsecores_per_device=args.sparsecores_per_device, iterations=args.iterations)
    _at_least(0, warmup=args.warmup)
    rows = _rows(args.rows, args.tables)
    if args.dim < 8 or args.dim % 8:
        raise BenchOptionError(
            f"--dim {args.dim}: SparseCore rows are a multiple of 8 floats; use a multiple of 8 "
            f"(e.g. {max(8, args.dim // 8 * 8)} or {max(8, (args.dim + 7) // 8 * 8)})"
        )
    bags = BagLengths.parse(args.ids_per_bag)
    smallest = min(range(args.tables), key=lambda t: rows[t])
    if bags.high > rows[smallest]:
        raise BenchOptionError(
            f"--ids-per-bag {bags}: a bag holds up to {bags.high} distinct ids but table t{smallest} has only "
            f"{rows[smallest]} rows; lower --ids-per-bag to at most {rows[smallest]} or raise --rows"
        )
    if args.optimizer not in OPTIMIZERS:
        raise BenchOptionError(
            f"--optimizer {args.optimizer!r} is unknown here; use one of {', '.join(OPTIMIZERS)} (the fused "
            "optimizers FBGEMM's CPU TBE, the baseline, has)"
        )
    if not args.learning_rate > 0:
        raise BenchOptionError(f"--learning-rate {args.learning_rate}: must be positive")
    _check_sharding(args.sharding)
    if args.sparsecores_per_device & (args.sparsecores_per_device - 1):
        raise BenchOptionError(f"--sparsecores-per-device {args.sparsecores_per_device}: must be a power of two")
    sparsecores = args.processes * args.devices * args.sparsecores_per_device
    if args.batch_size % sparsecores:
        lower = max(sparsecores, args.batch_size // sparsecores * sparsecores)
        raise BenchOptionError(
            f"--batch-size {args.batch_size}: MOD sharding splits the batch evenly over all {sparsecores} SparseCores "
            f"({args.processes} processes x {args.devices} devices x {args.sparsecores_per_device}); use a multiple "
            f"of {sparsecores} (e.g. {lower})"
        )
    return BenchConfig(
        tables=args.tables,
        rows=rows,
        dim=args.dim,
        batch_size=args.batch_size,
        ids_per_bag=bags,
        id_distribution=IdDistribution.parse(args.id_distribution),
        combiner=args.combiner,
        optimizer=args.optimizer,
        learning_rate=args.learning_rate,
        training=args.mode == "training",
        sharding=args.sharding,
        sparsecores_per_device=args.sparsecores_per_device,
        stacking=args.stacking,
        devices=args.devices,
        processes=args.processes,
        eager_mode=args.eager_mode,
        warmup=args.warmup,
        iterations=args.iterations,
        seed=args.seed,
    )


def _at_least(minimum: int, **values: int) -> None:
    for name, value in values.items():
        if value < minimum:
            raise BenchOptionError(f"--{name.replace('_', '-')} {value}: must be at least {minimum}")


def _rows(text: str, tables: int) -> tuple[int, ...]:
    try:
        rows = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise BenchOptionError(f"--rows {text!r}: expected a row count or one count per table, comma-separated") from None
    if len(rows) == 1:
        rows = rows * tables
    if len(rows) != tables:
        raise BenchOptionError(f"--rows {text!r}: {len(rows)} counts for {tables} tables; give one count or {tables}")
    if min(rows) < 1:
        raise BenchOptionError(f"--rows {text!r}: every table needs at least one row")
    return rows


def _check_sharding(sharding: str) -> None:
    if sharding == "mod":
        return
    if sharding not in PLUGIN_SHARDING_TYPES:
        raise BenchOptionError(
            f"--sharding {sharding!r} is unknown; use mod, or a TorchRec type ({', '.join(PLUGIN_SHARDING_TYPES)})"
        )
    has_plugin = importlib.util.find_spec("torchrec_plugin.sharders") is not None
    raise BenchOptionError(
        f"--sharding {sharding}: TorchRec sharding types run under DistributedModelParallel with the TorchRec plugin's "
        + (
            "sharders, which this benchmark does not drive yet"
            if has_plugin
            else "sharders (torchrec_plugin.sharders), which this installation does not have"
        )
        + "; use --sharding mod (the SparseCore collections' MOD layout over every SparseCore)"
    )
