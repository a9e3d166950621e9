"""Median time of one local step (no sync) of the periodic transforms against a plain optax step.

    python scripts/local_step_timing.py {simulate|mesh} REPLICAS PARAMS

Precomputed gradients, flat parameters (four square float32 matrices), ``optax.sgd(0.01,
momentum=0.9)`` as the inner optimizer, ``period=30``; the step counter sits at a local step
(after step 0, which runs the start check). Interleaved calls, medians of 15. For the mesh
harness set ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` on a CPU-only machine.
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import optaxdist as od
from optaxdist import topology


def main(harness: str, n: int, size: int, repeats: int = 15) -> None:
    side = int((size / 4) ** 0.5)
    params = od.replicate({f"w{i}": jnp.zeros((side, side)) for i in range(4)}, n)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, params)
    comm = od.AxisComm(od.REPLICA_AXIS)
    if harness == "mesh":
        mesh = jax.make_mesh(
            (n,), (od.REPLICA_AXIS,), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
        )
        wrap = lambda f: od.on_mesh(f, mesh)
    else:
        wrap = od.simulate
    inner = optax.sgd(0.01, momentum=0.9)
    transforms = {
        "plain optax": inner,
        "local_sgd": od.local_sgd(inner, comm=comm, period=30),
        "local_sgd nonfinite=ignore": od.local_sgd(inner, comm=comm, period=30, nonfinite="ignore"),
        "diloco": od.diloco(inner, comm=comm, period=30),
        "diloco nonfinite=ignore": od.diloco(inner, comm=comm, period=30, nonfinite="ignore"),
        "streaming_diloco nonfinite=ignore": od.streaming_diloco(
            inner, comm=comm, period=30, num_fragments=3, nonfinite="ignore"
        ),
        "decentralized_sgd (ring) nonfinite=ignore": od.decentralized_sgd(
            inner, comm=comm, topology=topology.ring(n), nonfinite="ignore"
        ),
    }
    runs = {}
    for name, tx in transforms.items():

        def step(p, s, g, tx=tx):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        f = wrap(step)
        p1, s1 = f(params, wrap(tx.init)(params), grads)  # step 0: the start check
        jax.block_until_ready(f(p1, s1, grads))
        runs[name] = (f, p1, s1)
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, (f, p, s) in runs.items():
            t = time.perf_counter()
            jax.block_until_ready(f(p, s, grads))
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["plain optax"])
    print(f"{harness}, {n} replicas, {size:,} params, {jax.default_backend()}")
    print("| step | ms (median) | / plain |\n|---|---|---|")
    for name, v in times.items():
        m = statistics.median(v)
        print(f"| {name} | {m * 1e3:.3f} | {m / base:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
