"""``optaxdist merge``: one table and one set of figures from train records run apart.

Rows of one table are often run in separate processes (one per algorithm, side by side, or on
another machine); each writes its own ``bench_<dataset>_<shards>.json``. Merging them is only
meaningful when they ran the same experiment: same data (the dataset's name carries its content
hash), model, configuration (all but the algorithm list and where it was written), cost model and
platform (JAX and optax versions, backend and device kind: the same code gives other losses, and
other measured times, elsewhere). A record that differs from the first in any of these is refused,
naming the field and both values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

# configuration fields that may differ between the runs of one table
PER_RUN_CONFIG = ("algorithms", "out", "plots", "progress")
PLATFORM = ("jax", "optax", "backend", "device_kind")
REQUIRED = ("config", "dataset", "model", "cost_model", "results")


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{where}.{k}")
        return out
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def _comparable(record: dict[str, Any]) -> dict[str, Any]:
    """The parts of a record that must agree between the runs of one table."""
    config = {k: v for k, v in record["config"].items() if k not in PER_RUN_CONFIG}
    # options left at their defaults compare equal to the same values spelled out
    if config.get("nodes") is None:  # one replica per node
        config["nodes"] = config.get("replicas")
    if config.get("transformer") is None:  # the model's shape is recorded either way
        config["transformer"] = record["model"].get("width_layers_heads")
    platform = {k: record.get("environment", {}).get(k) for k in PLATFORM}
    return {
        "dataset": record["dataset"],
        "model": record["model"],
        "config": config,
        "cost_model": record["cost_model"],
        "environment": platform,
    }


def merge_records(records: Sequence[dict[str, Any]], names: Sequence[str] | None = None) -> dict[str, Any]:
    """One record with the results of all ``records``, in order; ``ValueError`` when they ran
    different experiments or repeat an algorithm. ``names`` label the records in the errors."""
    if not records:
        raise ValueError("merge needs at least one record")
    names = list(names) if names is not None else [f"record {i}" for i in range(len(records))]
    first = _comparable(records[0])
    for name, record in zip(names[1:], records[1:]):
        found = _differences(first, _comparable(record), "")
        if found:
            raise ValueError(
                f"{name} ran another experiment than {names[0]} ({'; '.join(d.lstrip('.') for d in found)}): "
                "rows of one table must share data, model, configuration, cost model and platform"
            )
    results, seen = [], {}
    for name, record in zip(names, records):
        for r in record["results"]:
            if r["algorithm"] in seen:
                raise ValueError(f"algorithm {r['algorithm']!r} is in both {seen[r['algorithm']]} and {name}")
            seen[r["algorithm"]] = name
            results.append(r)
    merged = dict(records[0])
    merged["config"] = dict(records[0]["config"], algorithms=[r["algorithm"] for r in results])
    merged["results"] = results
    merged["wall_s"] = sum(r.get("wall_s", 0.0) for r in records)
    merged["merged_from"] = list(names)
    return merged


def load(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The train records in ``paths`` (JSON files written by ``optaxdist bench --out``)."""
    records = []
    for path in paths:
        try:
            with open(path) as f:
                record = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a train record of optaxdist bench (not JSON: {e})") from None
        missing = [k for k in REQUIRED if k not in record] if isinstance(record, dict) else list(REQUIRED)
        if missing:
            raise ValueError(
                f"{path} is not a train record of optaxdist bench (the train suite's JSON): it has no "
                f"{', '.join(missing)}"
            )
        records.append(record)
    return records
