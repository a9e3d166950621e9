"""Replicas whose parameters are sharded over a model axis: ``on_mesh(..., axis_name="replica")``
on a ``("replica", "model")`` mesh is manual over the replica axis only and leaves the model axis to
the compiler, so each replica's kernels stay sharded while the transforms communicate between
replicas. Here: the start check on such a mesh, and the placement ``on_mesh`` refuses. Every
transform against ``simulate`` on such meshes: tests/test_sharded_models.py."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist as od
from optaxdist.bench.data import random_normal

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
        {"w1": random_normal(k1, (16, 32)) * 0.1, "w2": random_normal(k2, (32, 4)) * 0.1}, N
    )
    x, y = random_normal(k3, (N, 8, 16)), random_normal(k4, (N, 8, 4))
    return params, x, y


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def test_start_check_runs_under_partial_auto_sharding(monkeypatch):
    """The default ``check_start=True`` on a ``("replica", "model")`` mesh: its host callback runs in
    a nested shard_map that makes "model" manual too. Identical replicas pass, and only step 0
    runs the callback; replicas that start different raise the clear error."""
    from optaxdist.transforms import _start

    calls = []

    def counted(same):
        calls.append(1)
        return _verdict(same)

    _verdict = _start._verdict
    monkeypatch.setattr(_start, "_verdict", counted)
    tx = od.diloco(optax.sgd(0.1), comm=COMM, period=2)

    def step(p, s, x, y):
        u, s = tx.update(jax.grad(_loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    params, x, y = _problem()
    mesh = _mesh()
    kernels = {
        "w1": NamedSharding(mesh, P(od.REPLICA_AXIS, None, "model")),
        "w2": NamedSharding(mesh, P(od.REPLICA_AXIS, "model", None)),
    }
    got = jax.device_put(params, kernels)
    init = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)
    run = od.on_mesh(step, mesh, axis_name=od.REPLICA_AXIS)
    state = init(got)
    for t in range(3):
        got, state = run(got, state, x, y)
        jax.block_until_ready(got)
        assert len(calls) == 2 * N, t  # one verdict per device, at step 0 only
    assert got["w1"].sharding.spec == P(od.REPLICA_AXIS, None, "model")
    assert od.comm_stats(state).by_kind["broadcast[start check]"].collectives == 1

    different = jax.device_put(jax.tree.map(lambda v: v.at[N - 1].add(1e-3), params), kernels)
    with pytest.raises(Exception, match="do not start from identical parameters"):
        jax.block_until_ready(run(different, init(different), x, y))


@pytest.mark.parametrize(
    "spec,bad",
    [
        (P(None, od.REPLICA_AXIS), r"splits dimension 1 over the replica axes \['replica'\]"),
        (P(None, None, od.REPLICA_AXIS), r"splits dimension 2 over the replica axes \['replica'\]"),
        (P((od.REPLICA_AXIS, "model"), None), r"leading \(stacked\) dimension over \['replica', 'model'\]"),
    ],
)
def test_on_mesh_refuses_a_replica_axis_off_the_leading_dimension(spec, bad):
    mesh = _mesh()
    run = od.on_mesh(lambda p: jax.tree.map(lambda v: v * 2, p), mesh, axis_name=od.REPLICA_AXIS)
    ok = jax.device_put(jnp.ones((N, 8, 4)), NamedSharding(mesh, P(od.REPLICA_AXIS, "model")))
    np.testing.assert_array_equal(run({"a": ok, "b": ok})["b"], 2.0)  # the leading dimension: fine
    rows = 2 * N if isinstance(spec[0], tuple) else N  # the leading dimension split 8 ways
    wrong = jax.device_put(jnp.ones((rows, 8, 4)), NamedSharding(mesh, spec))
    with pytest.raises(ValueError, match=r"on_mesh argument 0, leaf \['b'\]: its sharding .*" + bad):
        run({"a": ok, "b": wrong})
    with pytest.raises(ValueError, match=r"argument 1, leaf \(the argument\).*" + bad):
        od.on_mesh(lambda p, q: q, mesh, axis_name=od.REPLICA_AXIS)(ok, wrong)


def test_harnesses_refuse_arguments_not_stacked_over_their_replicas():
    """A leading axis of another length than the replicas' is an error, not a run on some rows:
    ``on_mesh`` over 4 devices given 8 rows (a multiple of 4, which ``shard_map`` would split 2
    per device), or 4 rows next to 8; ``simulate`` with a ``shape`` that does not match."""
    mesh = jax.make_mesh((N,), (od.REPLICA_AXIS,), devices=jax.devices()[:N])
    double = od.on_mesh(lambda p, q: (p, q), mesh)
    fine = jnp.zeros((N, 2))
    np.testing.assert_array_equal(double(fine, fine)[0], fine)
    stacked = r"has shape \(8, 2\); every argument must be stacked over the 4 replicas"
    with pytest.raises(ValueError, match=r"argument 1, leaf \['w'\] " + stacked):
        double(fine, {"w": jnp.zeros((2 * N, 2))})
    with pytest.raises(ValueError, match=r"argument 0, leaf \(the argument\) has shape \(8, 2\)"):
        od.on_mesh(lambda p: p, mesh, split_local_steps=True)(jnp.zeros((2 * N, 2)))
    nested = od.simulate(lambda p: p, axis_name=("node", "local"), shape=(2, 2))
    with pytest.raises(ValueError, match=r"simulate over \{'node': 2, 'local': 2\}: argument 0.* \(8,\)"):
        nested(jnp.zeros(2 * N))
    with pytest.raises(ValueError, match=r"shape=\(2, 4\) must give one size per axis"):
        od.simulate(lambda p: p, shape=(2, 4))
    with pytest.raises(ValueError, match=r"shape\[1\]=0 must be an int ≥ 1"):
        od.simulate(lambda p: p, axis_name=("node", "local"), shape=(2, 0))
    sizes = np.array([2, 2])  # NumPy sizes are sizes
    np.testing.assert_array_equal(
        od.simulate(lambda p: p, axis_name=("node", "local"), shape=sizes)(fine), fine
    )
    with pytest.raises(ValueError, match=r"needs shape= with one size per axis"):
        od.simulate(lambda p: p, axis_name=("node", "local"))
