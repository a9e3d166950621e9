"""Replicas whose parameters are sharded over a model axis: ``on_mesh(..., axis_name="replica")``
on a ``("replica", "model")`` mesh is manual over the replica axis only and leaves the model axis to
the compiler, so each replica's kernels stay sharded while the transforms communicate between
replicas."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist as od

COMM = od.AxisComm(od.REPLICA_AXIS)
N = 4


def _mesh():
    devices = np.asarray(jax.devices()[: 2 * N]).reshape(N, 2)
    return jax.sharding.Mesh(
        devices, (od.REPLICA_AXIS, "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _problem():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = od.replicate(
        {"w1": jax.random.normal(k1, (16, 32)) * 0.1, "w2": jax.random.normal(k2, (32, 4)) * 0.1}, N
    )
    x, y = jax.random.normal(k3, (N, 8, 16)), jax.random.normal(k4, (N, 8, 4))
    return params, x, y


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


TRANSFORMS = {
    "allreduce": lambda: optax.chain(od.allreduce(comm=COMM), optax.sgd(0.1)),
    "top_k": lambda: optax.chain(
        od.compressed_allreduce(od.compress.top_k(fraction=0.1), comm=COMM), optax.sgd(0.1)
    ),
    "diloco": lambda: od.diloco(optax.sgd(0.1), comm=COMM, period=2, check_start=False),
    "powersgd": lambda: optax.chain(od.powersgd(comm=COMM, rank=2, warmup_steps=1), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_model_sharded_replicas_match_simulation(name):
    tx = TRANSFORMS[name]()

    def step(p, s, x, y):
        u, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    params, x, y = _problem()
    want, state = params, od.simulate(tx.init)(params)
    simulated = od.simulate(step)
    for _ in range(4):
        want, state = simulated(want, state, x, y)

    mesh = _mesh()
    kernels = {
        "w1": NamedSharding(mesh, P(od.REPLICA_AXIS, None, "model")),
        "w2": NamedSharding(mesh, P(od.REPLICA_AXIS, "model", None)),
    }
    got = jax.device_put(params, kernels)
    state = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)(got)
    run = od.on_mesh(step, mesh, axis_name=od.REPLICA_AXIS)
    for _ in range(4):
        got, state = run(got, state, x, y)
    assert got["w1"].sharding.spec == P(od.REPLICA_AXIS, None, "model")  # still sharded on "model"
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-6)


def test_start_check_under_partial_auto_sharding_is_refused_clearly():
    tx = od.diloco(optax.sgd(0.1), comm=COMM, period=2)
    params, _, _ = _problem()
    mesh = _mesh()
    state = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)(params)
    run = od.on_mesh(lambda p, s: tx.update(p, s, p), mesh, axis_name=od.REPLICA_AXIS)
    with pytest.raises(
        ValueError, match=r"check_start=True cannot run .* mesh axes \['model'\] .* check_start=False"
    ):
        run(params, state)
