"""Loading the committed jax-tpu-embedding 0.2.0 golden cases as this project's specs and inputs.

The data (tests/sparsecore/golden/jax_tpu_embedding, a copy of the team's golden folder) was
produced by Google's library; its README states the semantics. Nothing here computes expected
values: it only translates each case's settings into TableSpec / FeatureSpec / stacks.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import numpy as np

from sparsecore.layout import StackedTable, StackGroup, auto_stack_tables, stack_tables
from sparsecore.preprocess import RaggedIds
from sparsecore.spec import FeatureSpec, TableSpec
from sparsecore.topology import Topology

GOLDEN = Path(__file__).parent / "golden" / "jax_tpu_embedding"


@cache
def index() -> tuple[dict, ...]:
    return tuple(json.loads((GOLDEN / "cases_index.json").read_text())["cases"])


def names(kind: str, **filters: object) -> list[str]:
    return [
        c["case"]
        for c in index()
        if c["kind"] == kind and all(c.get(k) == v for k, v in filters.items())
    ]


@cache
def case(name: str) -> dict:
    return json.loads((GOLDEN / name / "case.json").read_text())


def npz(name: str, file: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / name / file) as data:
        return {key: data[key] for key in data.files}


def topology(name: str) -> Topology:
    t = case(name)["topology"]
    return Topology.cpu(
        t["global_device_count"], t["num_sc_per_device"], local_device_count=t["local_device_count"]
    )


def tables(name: str, limits: dict | None = None) -> dict[str, TableSpec]:
    """TableSpecs of a case; `limits[table]` may override (max_ids, max_unique) (FDO pass 1)."""
    specs = {}
    for t in case(name)["tables"]:
        max_ids, max_unique = (limits or {}).get(
            t["name"], (t["max_ids_per_partition"], t["max_unique_ids_per_partition"])
        )
        specs[t["name"]] = TableSpec(
            t["name"],
            t["vocabulary_size"],
            t["embedding_dim"],
            combiner=t["combiner"],
            optimizer="sgd",
            max_ids_per_partition=max_ids,
            max_unique_ids_per_partition=max_unique,
            suggested_coo_buffer_size_per_device=t["suggested_coo_buffer_size_per_device"],
        )
    return specs


def features(name: str) -> dict[str, FeatureSpec]:
    """FeatureSpecs keyed by name (a dict, so stacking sees them in sorted-key order as the
    library's feature tree). The case's batch is this host's; FeatureSpec takes the global one."""
    c = case(name)
    t = c["topology"]
    specs = tables(name)
    return {
        f["name"]: FeatureSpec(
            f["name"],
            specs[f["table"]],
            f["batch_size"] * t["global_device_count"] // t["local_device_count"],
        )
        for f in c["features"]
    }


def stacks(name: str, stack_limits: str = "recorded") -> tuple[StackedTable, ...]:
    """The case's stacks, built by this project's stacking from the case's stacking request.

    Multi-table stacks get the limits the library used: `stack_limits="recorded"` takes them from
    `stacked_tables` (after FDO for p37), `"first_pass"` from p37's `fdo_first_pass`.
    """
    c = case(name)
    topo = topology(name)
    stacking = c["stacking"]
    feats = features(name)
    if stacking["mode"] in ("none", "feature_stacking"):
        return stack_tables(feats, topo)
    if stacking["mode"] == "manual":
        groups = [
            StackGroup(
                tuple(g["tables"]),
                name=g["stack_name"],
                rotation=g["rotation"],
                max_ids_per_partition=g["max_ids"],
                max_unique_ids_per_partition=g["max_unique"],
            )
            for g in stacking["groups"]
        ]
        return stack_tables(feats, topo, groups)
    auto = auto_stack_tables(feats, topo, rotation=stacking["auto_args"]["rotation"])
    recorded = {s["stack_name"]: s for s in stacking["stacked_tables"]}
    if stack_limits == "first_pass":
        recorded = {
            stack: {**recorded[stack], **limits}
            for stack, limits in c["fdo_first_pass"]["limits_before"].items()
        }
    return tuple(
        s.with_limits(
            recorded[s.name]["max_ids_per_partition"],
            recorded[s.name]["max_unique_ids_per_partition"],
            recorded[s.name]["suggested_coo_buffer_size_per_device"],
        )
        for s in auto
    )


def inputs(name: str) -> dict[str, RaggedIds]:
    data = npz(name, "inputs.npz")
    ragged = {}
    for f in case(name)["features"]:
        key = f["name"]
        ragged[key] = RaggedIds(
            data[f"{key}/values"],
            lengths=data[f"{key}/row_lengths"],
            weights=data.get(f"{key}/weights"),
        )
    return ragged
