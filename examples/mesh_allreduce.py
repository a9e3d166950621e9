"""Data-parallel SGD with one replica per device of a mesh (``jax.shard_map``).

On a CPU-only machine this forces 8 host devices, so it runs anywhere; on a GPU/TPU host drop the
XLA_FLAGS line and the mesh uses the real devices. The step function is the same as in
``simulate_allreduce.py``: only the harness changes.

    python examples/mesh_allreduce.py
"""

import os

# Must be set before JAX is imported (JAX reads it once, at backend start-up).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optaxdist  # noqa: E402

comm = optaxdist.AxisComm("replica")
tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(learning_rate=0.1))


def loss_fn(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def train_step(w, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(w, x, y)
    updates, opt_state = tx.update(grads, opt_state, w)
    return optax.apply_updates(w, updates), opt_state, comm.pmean(loss)


def main():
    n = jax.device_count()
    # AxisType.Auto: the outputs can be indexed like ordinary arrays (params[0]).
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))

    w_true = jnp.array([1.0, -2.0, 0.5])
    x = jax.random.normal(jax.random.PRNGKey(0), (n, 16, 3))
    y = x @ w_true

    params = optaxdist.replicate(jnp.zeros(3), n)
    opt_state = optaxdist.on_mesh(tx.init, mesh)(params)
    step = optaxdist.on_mesh(train_step, mesh)
    for _ in range(50):
        params, opt_state, loss = step(params, opt_state, x, y)

    optaxdist.assert_replicas_identical(params)
    print(f"{n} devices; final loss {float(loss[0]):.3e}; params {params[0]}")
    print("params sharding:", params.sharding)
    print("comm:", optaxdist.comm_stats(opt_state))

    # The same mesh seen as 2 nodes × 4 local devices: three communicators over one mesh.
    h = optaxdist.mesh_hierarchy(2, n // 2)

    def show_groups(v):
        return h.world.pmean(v), h.local.pmean(v), h.cross.pmean(v)

    world, local, cross = optaxdist.on_mesh(show_groups, h.mesh)(jnp.arange(float(n)))
    print("world mean:", world, "\nlocal mean:", local, "\ncross mean:", cross)


if __name__ == "__main__":
    main()
