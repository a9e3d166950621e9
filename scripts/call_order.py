"""How much a step's time depends on the program called just before it: a plain optax step and
a ``split_local_steps`` local step of ``local_sgd`` (period 10**6, ``nonfinite="ignore"``, no start
check), each timed right after a call of itself and right after a call of the other.

    python scripts/call_order.py {mesh|simulate} [ROUNDS]

The bench's 4-leaf MLP, 100k parameters per replica, 8 replicas, donated arguments. Medians in
ms, labelled "before|timed". For the mesh on a CPU-only machine set
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import statistics
import sys
import time

import jax

import optaxdist as od
from optaxdist.bench import local_steps as bench


def main(harness_name: str, rounds: int = 200) -> None:
    harness = bench.make_harness(harness_name, 8, hierarchical=False)
    inputs = bench.make_inputs(bench.default_params(8), 8)
    comm = od.AxisComm(od.REPLICA_AXIS)
    tx = od.local_sgd(bench.inner(), comm=comm, period=10**6, nonfinite="ignore", check_start=False)
    steps = {
        "ours": harness.wrap(bench._step(tx), donate=True, split=True),
        "plain": bench.reference_step(harness, None, True),
    }
    grads = harness.place(inputs.data)
    carried = {
        "ours": bench._copies(harness.place(inputs.params), harness.wrap(tx.init)(inputs.params)),
        "plain": bench._copies(
            harness.place(inputs.params), harness.place(harness.wrap(bench.inner().init)(inputs.params))
        ),
    }

    def call(name: str) -> float:
        t0 = time.perf_counter()
        carried[name] = jax.block_until_ready(steps[name](*carried[name], grads))
        return time.perf_counter() - t0

    orders = [("plain", "plain"), ("ours", "ours"), ("ours", "plain"), ("plain", "ours")]
    times: dict[str, list[float]] = {f"{a}|{b}": [] for a, b in orders}
    for i in range(rounds + 20):  # the first rounds warm up
        for before, timed in orders:
            call(before)
            elapsed = call(timed)
            if i >= 20:
                times[f"{before}|{timed}"].append(elapsed)
    print({k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()})


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
