"""One process per node, several devices each: the node's devices reduce among themselves, the
nodes through MPI, inside one jitted train step.

    mpirun -n 2 python examples/mpi_one_process_per_node.py

Each process is a "node" of 4 CPU devices here (on a GPU cluster: one process per node, its GPUs,
and no XLA_FLAGS). Hierarchical local SGD averages inside the node every 2 steps and across nodes
every 4; every 8 replicas end bit-identical after the last cross-node average.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import optaxdist as od  # noqa: E402

h = od.node_hierarchy()  # local: this process's devices; cross: MPI; world: both composed
G, node = h.local_size, h.cross.rank
tx = od.local_sgd(optax.sgd(0.02, momentum=0.9), comm=h.world, local_comm=h.local, period=4, local_period=2)
true_w = jnp.arange(1.0, 9.0).reshape(8, 1)


def step(w, s, x):
    y = x @ true_w + 0.01 * jnp.sin(x.sum(1, keepdims=True))
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
    u, s = tx.update(g, s, w)
    return od.apply_updates(w, u, s), s, loss


run = od.on_node(step, h)
w = od.replicate(jnp.zeros((8, 1)), G)  # this node's G replicas, stacked
s = od.on_node(tx.init, h)(w)
rng = np.random.default_rng(node)  # every node has its own data, every device its own batch
for _ in range(100):
    w, s, loss = run(w, s, jnp.asarray(rng.normal(size=(G, 32, 8)), jnp.float32))
od.assert_replicas_identical(w)  # within this node; across nodes, the cross-node average agreed
spread = h.cross.mpi_comm.allgather(np.asarray(w[0]))
assert all(np.array_equal(spread[0], other) for other in spread)
stats = od.comm_stats(s)
print(f"node {node}: loss {float(loss.mean()):.4f}, w[:3] {np.asarray(w[0, :3, 0]).round(3)}, ", end="")
print(f"{stats.bytes} B sent per replica in {stats.collectives} collectives", flush=True)
