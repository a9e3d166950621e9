"""The host's share of a ``split_local_steps`` call: the whole call against its compiled program
called directly, on the same chain of states.

    python scripts/split_host_share.py {mesh|simulate} {local|sync} [REPEATS]

DiLoCo on the bench's 4-leaf MLP (100k parameters per replica, 8 replicas, ``nonfinite="ignore"``,
no start check). ``local``: period 10**6, every timed call runs the local program; ``sync``:
period 1, every timed call runs the synchronization's program. Each round makes one call of the
whole step and one direct call of the program it ran (on a second chain of states), and times
the harness's first lookup of the call's arguments right after a step and again at once (the
same Python work, with the caches the step's computation left and with warm ones). Medians, ms.
For the mesh on a CPU-only machine set
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import statistics
import sys
import time

import jax

import optaxdist as od
from optaxdist.bench import local_steps as bench
from optaxdist.parallel.split import LOCAL


def main(harness_name: str, kind: str, repeats: int = 300) -> None:
    harness = bench.make_harness(harness_name, 8, hierarchical=False)
    inputs = bench.make_inputs(bench.default_params(8), 8)
    period = 1 if kind == "sync" else 10**6
    comm = od.AxisComm(od.REPLICA_AXIS)
    tx = od.diloco(bench.inner(), comm=comm, period=period, nonfinite="ignore", check_start=False)
    step = harness.wrap(bench._step(tx), donate=True, split=True)
    grads = harness.place(inputs.data)
    params, state = bench._copies(harness.place(inputs.params), harness.wrap(tx.init)(inputs.params))
    for _ in range(4):
        params, state = jax.block_until_ready(step(params, state, grads))
    key = LOCAL if kind == "local" else next(iter(step._syncs))
    entry = step._recent[1]
    pruned = entry.pruned.get(key)
    if pruned is None:
        raise SystemExit(f"the {kind} program takes every argument here: nothing to compare")
    direct = bench._copies(params, state)
    times: dict[str, list[float]] = {
        "whole call": [],
        "program alone": [],
        "lookup, cold": [],
        "lookup, warm": [],
    }
    for _ in range(repeats):
        leaves, treedef = jax.tree.flatten((params, state, grads))
        t0 = time.perf_counter()
        step._entry(treedef, leaves)
        t1 = time.perf_counter()
        step._entry(treedef, leaves)
        times["lookup, cold"].append(t1 - t0)
        times["lookup, warm"].append(time.perf_counter() - t1)
        t0 = time.perf_counter()
        params, state = jax.block_until_ready(step(params, state, grads))
        times["whole call"].append(time.perf_counter() - t0)
        leaves = jax.tree.leaves((*direct, grads))
        t0 = time.perf_counter()
        results = jax.block_until_ready(pruned.program(pruned.take_donated(leaves), pruned.take_kept(leaves)))
        times["program alone"].append(time.perf_counter() - t0)
        out = pruned.assemble((*results, *leaves, *entry.constants.get(key, ())))
        direct = jax.tree.unflatten(pruned.out_treedef, out)
    print({name: round(statistics.median(v) * 1e3, 4) for name, v in times.items()})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
