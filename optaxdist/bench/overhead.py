"""Abstraction cost: ``allreduce(comm) + optax.sgd`` vs a hand-written ``lax.pmean`` + sgd step.

Both steps take precomputed per-replica gradients (no model), all-reduce them over ``N`` replicas
and apply SGD to a flat params pytree of four square float32 matrices. Each is jitted, run once to
warm up, then timed ``repeats`` times (alternating the two, ``block_until_ready`` after each call);
the median (and the minimum, less sensitive to a busy machine) is reported with the ratio
ours / hand-written (target ≤ 1.05). Harnesses:
``simulate`` (vmap on one device) and, when at least ``N`` devices exist, ``on_mesh``
(shard_map over an ``N``-device mesh). The compiled HLO of both is summarised (instruction counts
per opcode) so a difference can be traced to the ops that cause it.

The suite's second kind of rows (``rows=("local-steps",)``, in ``optaxdist.bench.local_steps``)
times the local step and the sync step of every periodic-synchronization transform against a plain
optax step and against the same collective written by hand, with compile times and optimizer-state
bytes per parameter byte.
"""

from __future__ import annotations

import collections
import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

import optaxdist
from optaxdist.bench.data import random_normal

_SUFFIX = {"K": 10**3, "M": 10**6, "G": 10**9}


def parse_size(text: str) -> int:
    """``"25M"`` → 25_000_000; ``"1000"`` → 1000."""
    text = text.strip().upper()
    scale = _SUFFIX.get(text[-1:], 1)
    value = float(text[:-1] if text[-1:] in _SUFFIX else text)
    n = int(value * scale)
    if n < 4:
        raise ValueError(f"size {text!r} must be at least 4 parameters")
    return n


def make_params(n_params: int, leaves: int = 4) -> dict[str, jax.Array]:
    """``leaves`` square float32 matrices with about ``n_params`` elements in total (zeros)."""
    side = max(1, round(math.sqrt(n_params / leaves)))
    return {f"w{i}": jnp.zeros((side, side), jnp.float32) for i in range(leaves)}


def _steps(lr: float) -> tuple[Callable, Callable, Any, Any]:
    comm = optaxdist.AxisComm(optaxdist.REPLICA_AXIS)
    ours_tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(lr))
    hand_tx = optax.sgd(lr)

    def ours(params, state, grads):
        updates, state = ours_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def hand(params, state, grads):
        grads = jax.lax.pmean(grads, optaxdist.REPLICA_AXIS)
        updates, state = hand_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return ours, hand, ours_tx, hand_tx


def hlo_summary(compiled: Any) -> dict[str, Any]:
    """Instruction counts per opcode of a compiled computation (all computations of the module)."""
    text = compiled.as_text()
    ops = collections.Counter(m.group(1) for m in re.finditer(r"=\s*[^\s]+\s+([a-z][a-z0-9\-]*)\(", text))
    return {"instructions": sum(ops.values()), "opcodes": dict(sorted(ops.items()))}


def _time(fns: Sequence[Callable[[], Any]], repeats: int) -> list[list[float]]:
    for fn in fns:  # warm-up (compilation happened before)
        jax.block_until_ready(fn())
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - t)
    return times


def measure(
    n_params: int,
    *,
    replicas: int = 8,
    harness: str = "simulate",
    repeats: int = 7,
    lr: float = 0.01,
    seed: int = 0,
) -> dict[str, Any]:
    """Median step time of ours vs hand-written, one size, one harness (``simulate``/``mesh``)."""
    ours, hand, ours_tx, hand_tx = _steps(lr)
    params = optaxdist.replicate(make_params(n_params), replicas)
    keys = jax.random.split(jax.random.key(seed), len(params))
    grads = {k: random_normal(kk, v.shape, v.dtype) for (k, v), kk in zip(params.items(), keys, strict=True)}
    ours_state = jax.vmap(ours_tx.init)(params)
    hand_state = jax.vmap(hand_tx.init)(params)
    if harness == "simulate":
        wrap = optaxdist.simulate
    elif harness == "mesh":
        if len(jax.devices()) < replicas:
            raise RuntimeError(f"the mesh harness needs {replicas} devices, have {len(jax.devices())}")
        mesh = jax.make_mesh((replicas,), (optaxdist.REPLICA_AXIS,), devices=jax.devices()[:replicas])
        wrap = lambda f: optaxdist.on_mesh(f, mesh)
    else:
        raise ValueError(f"harness={harness!r}; allowed: 'simulate', 'mesh'")
    f_ours, f_hand = wrap(ours), wrap(hand)
    c_ours = f_ours.lower(params, ours_state, grads).compile()
    c_hand = f_hand.lower(params, hand_state, grads).compile()
    t_ours, t_hand = _time(
        [lambda: f_ours(params, ours_state, grads), lambda: f_hand(params, hand_state, grads)],
        repeats,
    )
    m_ours, m_hand = statistics.median(t_ours), statistics.median(t_hand)
    n_actual = sum(int(x[0].size) for x in jax.tree.leaves(params))
    h_ours, h_hand = hlo_summary(c_ours), hlo_summary(c_hand)
    ops = set(h_ours["opcodes"]) | set(h_hand["opcodes"])
    extra = {k: h_ours["opcodes"].get(k, 0) - h_hand["opcodes"].get(k, 0) for k in sorted(ops)}
    return {
        "harness": harness,
        "replicas": replicas,
        "parameters": n_actual,
        "repeats": repeats,
        "ours_s": m_ours,
        "hand_s": m_hand,
        "ratio": m_ours / m_hand,
        "ours_min_s": min(t_ours),
        "hand_min_s": min(t_hand),
        "ratio_min": min(t_ours) / min(t_hand),
        "ours_all_s": t_ours,
        "hand_all_s": t_hand,
        "hlo": {"ours": h_ours, "hand": h_hand, "extra_in_ours": {k: v for k, v in extra.items() if v}},
    }


ROWS = ("abstraction", "local-steps")


def run_overhead(
    sizes: Sequence[int],
    *,
    replicas: int = 8,
    harnesses: Sequence[str] = ("simulate",),
    repeats: int = 7,
    progress: bool = True,
    rows: Sequence[str] = ("abstraction",),
    local_steps: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the suite's ``rows``, print their tables and return the JSON record.

    ``"abstraction"``: ``measure`` every size on every harness (record ``results``).
    ``"local-steps"``: ``local_steps.run_local_steps(**local_steps)`` (record ``local_steps``;
    its ``repeats`` and ``progress`` default to this call's).
    """
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; allowed: {ROWS}")
    results = []
    if "abstraction" in rows:
        for harness in harnesses:
            for n in sizes:
                if progress:
                    print(f"[overhead] {harness}, {n} params ...", file=sys.stderr, flush=True)
                results.append(measure(n, replicas=replicas, harness=harness, repeats=repeats))
    record: dict[str, Any] = {"suite": "overhead", "rows": list(rows), "replicas": replicas}
    record["results"] = results
    if results:
        print(format_overhead(record))
    if "local-steps" in rows:
        from optaxdist.bench.local_steps import format_local_steps, run_local_steps

        options = {"repeats": repeats, "progress": progress, **(local_steps or {})}
        record["local_steps"] = run_local_steps(**options)
        print(("\n" if results else "") + format_local_steps(record["local_steps"]))
    return record


def format_overhead(record: dict[str, Any]) -> str:
    """Markdown table of an overhead record."""
    out = [
        "| harness | parameters | allreduce+sgd ms (median) | pmean+sgd ms (median) | "
        "ratio (medians) | ratio (minimums) | HLO instructions ours / hand |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]:
        out.append(
            f"| {r['harness']} | {r['parameters']:,} | {r['ours_s'] * 1e3:.3f} | "
            f"{r['hand_s'] * 1e3:.3f} | {r['ratio']:.3f} | {r['ratio_min']:.3f} | "
            f"{r['hlo']['ours']['instructions']} / {r['hlo']['hand']['instructions']} |"
        )
    return "\n".join(out)
