"""One node of the deadline test (started by tests/test_node_faults.py under ``mpirun -n 2``).

Each process is a node of 4 CPU devices running an all-reduce step through ``on_node`` with
``node_hierarchy(timeout_s=...)``. Rank 1 runs one step fewer than rank 0 and then waits in a
host-side barrier (as a program whose node skipped a step reaches its end), so rank 0's last step
waits for a peer that never comes: its exchange must time out, name what it waited for, and end the
job. Rank 0 prints ``LAST STEP <unix time>`` when it starts that step.
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optaxdist as od  # noqa: E402

h = od.node_hierarchy(timeout_s=float(sys.argv[1]))
node, G = h.cross.rank, h.local_size
tx = optax.chain(od.allreduce(comm=h.world), optax.sgd(0.1))


def step(w, s, x):
    g = jax.grad(lambda w: jnp.sum((w - x) ** 2))(w)
    u, s = tx.update(g, s, w)
    return optax.apply_updates(w, u), s


w = od.replicate(jnp.zeros(64), G)
s = od.on_node(tx.init, h)(w)
run = od.on_node(step, h)
x = jnp.ones((G, 64))
steps = 3 if node == 0 else 2
for i in range(steps):
    if node == 0 and i == steps - 1:
        print(f"LAST STEP {time.time()}", flush=True)
    w, s = run(w, s, x)
h.cross.mpi_comm.Barrier()
print(f"rank {node}: not reached", flush=True)
