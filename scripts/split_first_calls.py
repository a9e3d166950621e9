"""Seconds of the first calls of a ``split_local_steps`` step: what compiling its programs costs.

    python scripts/split_first_calls.py {simulate|mesh} TRANSFORM [LEAVES]

The bench's row of TRANSFORM (``nonfinite="ignore"``, 8 replicas, 100k parameters per replica in
LEAVES square matrices, default 200: a model's layers) under ``split_local_steps=True`` with
donation: one call from a local step's state (the general program: it traces the step), two more
from that state (the local program), then three from a synchronization's state (its program).
Each call gets fresh copies of the state and waits for its results. A program compiled at its
first call makes that call's seconds; any call after it that still compiles shows too. For the
mesh on a CPU-only machine set ``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import sys
import time

import jax

from optaxdist.bench import local_steps as bench


def main(harness_name: str, name: str, leaves: int = 200) -> None:
    case = bench.cases()[name]
    harness = bench.make_harness(harness_name, 8, hierarchical=case.hierarchical)
    inputs = bench.make_inputs(bench.default_params(8), 8, leaves=leaves)
    tx = case.build(8, nonfinite="ignore")
    step = harness.wrap(bench._step(tx), donate=True, split=True)
    grads, params = harness.place(inputs.data), harness.place(inputs.params)
    state = harness.wrap(tx.init)(inputs.params)
    calls = [("general", case.local_at)] + [("local", case.local_at)] * 2 + [("sync", case.sync_at)] * 3
    seconds = []
    for label, at in calls:
        args = bench._copies(params, harness.place(bench._at(state, at)))
        t0 = time.perf_counter()
        jax.block_until_ready(step(*args, grads))
        seconds.append(f"{label} {time.perf_counter() - t0:.3f}")
    print(f"{name}, {harness_name}, {inputs.parameters} parameters in {leaves} arrays:", ", ".join(seconds))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
