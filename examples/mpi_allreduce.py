"""Data-parallel SGD under MPI: one process per device, collectives through mpi4jax.

    mpirun -n 2 python examples/mpi_allreduce.py
    mpirun -n 4 python examples/mpi_allreduce.py

Each process holds only its own replica (no stacked leading axis). Parameters start from a
different random draw on each rank and are made identical with ``broadcast_from_root``.
"""

import jax
import jax.numpy as jnp
import optax

import optaxdist

comm = optaxdist.MpiComm()  # MPI.COMM_WORLD
tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(learning_rate=0.1))


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def train_step(w, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, comm.pmean(loss)


def main():
    rank, size = comm.rank, comm.size
    w_true = jnp.array([1.0, -2.0, 0.5])
    x = jax.random.normal(jax.random.PRNGKey(0), (size, 16, 3))[rank]  # this rank's shard
    y = x @ w_true

    params = jax.random.normal(jax.random.PRNGKey(rank), (3,))  # differs on every rank...
    sync = optaxdist.on_mpi(lambda p: optaxdist.broadcast_from_root(p, comm=comm))
    params = sync(params)  # ...now rank 0's values everywhere
    opt_state = tx.init(params)

    step = optaxdist.on_mpi(train_step)
    for _ in range(50):
        params, opt_state, loss = step(params, opt_state, x, y)

    same = optaxdist.on_mpi(lambda p: optaxdist.replicas_identical(p, comm=comm))(params)
    stats = optaxdist.comm_stats(opt_state)
    print(
        f"rank {rank}/{size}: loss {float(loss):.3e} identical={bool(same)} "
        f"sent {stats.collectives} collectives / {stats.bytes} B",
        flush=True,
    )


if __name__ == "__main__":
    main()
