"""Synchronous data-parallel SGD with 8 simulated replicas on one device.

Each replica holds its own shard of a tiny linear-regression problem, computes its local gradient,
and ``optaxdist.allreduce`` averages the gradients before ``optax.sgd``. ``optaxdist.simulate``
runs the unchanged per-replica step under ``jax.vmap(axis_name="replica")``.

    python examples/simulate_allreduce.py
"""

import jax
import jax.numpy as jnp
import optax

import optaxdist

NUM_REPLICAS = 8
comm = optaxdist.AxisComm("replica")
tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(learning_rate=0.1))


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def train_step(w, opt_state, x, y):
    """One replica's step: local gradient -> all-reduce (inside tx) -> SGD."""
    loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, comm.pmean(loss)


def main():
    w_true = jnp.array([1.0, -2.0, 0.5])
    x = jax.random.normal(jax.random.PRNGKey(0), (NUM_REPLICAS, 16, 3))  # 16 samples per replica
    y = x @ w_true

    params = optaxdist.replicate(jnp.zeros(3), NUM_REPLICAS)  # stacked: shape (8, 3)
    opt_state = optaxdist.simulate(tx.init)(params)
    step = optaxdist.simulate(train_step)

    for i in range(50):
        params, opt_state, loss = step(params, opt_state, x, y)
        if i % 10 == 0 or i == 49:
            print(f"step {i:3d}  loss {float(loss[0]):.3e}")

    optaxdist.assert_replicas_identical(params)
    stats = optaxdist.comm_stats(opt_state)
    print("params (replica 0):", params[0])
    print(f"sent per replica: {stats.collectives} collectives, {stats.bytes} bytes")
    for kind, totals in stats.by_kind.items():
        print(f"  {kind}: {totals.collectives} collectives, {totals.bytes} B")


if __name__ == "__main__":
    main()
