"""Flax NNX and linen recipes (examples/nnx_mnist.py, examples/linen_trainstate.py, docs/flax.md):
the same numbers under ``simulate`` and ``on_mesh``, convergence on MNIST-5k, and the NNX helpers.

The examples' ``train`` functions are imported and run here with fewer steps, so the tests check
exactly the code the examples and docs show; the simulate == on_mesh tests swap in a smaller model
for the example's CNN (their cost is XLA compile time, which grows with the model's layers). They
use Adam, whose bias correction is not strict-promotion clean in optax: the tests run with JAX's
default promotion, as users do.
"""

import functools
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optaxdist as od
from optaxdist.bench.data import random_normal

ROOT = Path(__file__).resolve().parents[1]
N = 4


@pytest.fixture(autouse=True)
def _standard_promotion():
    with jax.numpy_dtype_promotion("standard"):
        yield


@functools.cache
def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.load_dataset = functools.cache(module.load_dataset)  # parse the csv once per session
    return module


def _arrays(tree) -> list[np.ndarray]:
    """Every leaf as a NumPy array (typed PRNG keys as their key data)."""
    out = []
    for x in jax.tree.leaves(tree):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(x))
    return out


def _max_diff(a, b) -> float:
    la, lb = _arrays(a), _arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.shape == y.shape and x.dtype == y.dtype
        if not np.issubdtype(x.dtype, np.floating):
            np.testing.assert_array_equal(x, y)  # counters, ledgers, steps: exactly equal
    return max(float(np.max(np.abs(x - y))) for x, y in zip(la, lb) if np.issubdtype(x.dtype, np.floating))


def _spread(stacked) -> float:
    """Largest difference between any replica's row and replica 0's."""
    return max(float(np.max(np.abs(x - x[:1]))) for x in _arrays(stacked))


def _assert_synchronized(stacked, algorithm):
    """All-reduce keeps the replicas bit-identical. DiLoCo returns the additive update
    ``anchor - params``, and ``params + (anchor - params)`` rounds differently per replica: after
    a sync the replicas agree to about one float32 ulp, not bit for bit."""
    if algorithm == "allreduce":
        od.assert_replicas_identical(stacked)
    else:
        assert _spread(stacked) <= 1e-6


def _mesh():
    return jax.make_mesh(
        (N,), (od.REPLICA_AXIS,), devices=jax.devices()[:N], axis_types=(jax.sharding.AxisType.Auto,)
    )


# ---- simulate == on_mesh ------------------------------------------------------------------------
# The per-device program of on_mesh and the vmapped program of simulate do the same arithmetic,
# except that vmap batches every operation on per-replica values, and XLA:CPU may pick another
# kernel (another summation order) for the batched one: a convolution with per-replica kernels
# becomes one grouped convolution, a matmul a batched matmul. The differences are in the last bit
# and depend on the shapes (a 32x784 @ 784x10 layer matched bit for bit, an 8x12 @ 12x32 one did
# not). So the runs agree to a few float32 ulps, not bit for bit; Adam, which divides by the
# gradient's running RMS, lets that grow only where a gradient is near zero. Measured max
# |simulate - mesh| over the whole state after 12 steps: NNX CNN 9e-8, linen CNN with BatchNorm
# 4e-6 (one Dense kernel entry); after the 3 steps tested here, less.


# The examples' CNNs are replaced by smaller ones with the same kinds of layers: one strided
# convolution (four channels) and the linear classifier, BatchNorm for linen, and no biases or
# BatchNorm scale, since every parameter adds its own optimizer arithmetic (Adam, DiLoCo's outer
# step, the start check) to each compiled step: compiling was most of the 21-22 s each test took with
# the examples' CNNs on 2 cores. The kernels are drawn as one flat vector: XLA:CPU takes seconds to
# compile jax's (partitionable) threefry for a 2-D or 4-D shape, a fraction of one for a 1-D shape.
# These models still differ in the last bits: max |simulate - mesh| after 3 steps, NNX 1e-8
# (DiLoCo) and 3e-8 (all-reduce), linen 5e-8 and 2.4e-6.


def _flat_lecun_normal(key, shape, dtype=jnp.float32):
    return random_normal(key, shape, dtype) / math.sqrt(math.prod(shape[:-1]))


class _SmallNnxCnn(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        kw = dict(use_bias=False, kernel_init=_flat_lecun_normal, rngs=rngs)
        self.conv = nnx.Conv(1, 4, (3, 3), strides=2, **kw)
        self.head = nnx.Linear(14 * 14 * 4, 10, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.relu(self.conv(x))
        return self.head(x.reshape(x.shape[0], -1))


class _SmallLinenCnn(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        x = nn.Conv(4, (3, 3), strides=2, use_bias=False, kernel_init=_flat_lecun_normal)(x)
        bn = nn.BatchNorm(use_running_average=not train, momentum=0.9, use_bias=False, use_scale=False)
        x = nn.relu(bn(x))
        return nn.Dense(10, use_bias=False, kernel_init=_flat_lecun_normal)(x.reshape(x.shape[0], -1))


@pytest.mark.parametrize("algorithm", [pytest.param("allreduce", marks=pytest.mark.slow), "diloco"])
def test_nnx_cnn_same_on_simulate_and_mesh(algorithm, monkeypatch):
    ex = _example("nnx_mnist")
    monkeypatch.setattr(ex, "CNN", _SmallNnxCnn)
    kw = dict(steps=3, replicas=N, algorithm=algorithm, batch_size=16, period=3)
    sim, mesh = ex.train(harness="simulate", **kw), ex.train(harness="mesh", **kw)
    assert _max_diff(sim["state"], mesh["state"]) <= 1e-6
    np.testing.assert_allclose(sim["losses"], mesh["losses"], rtol=0, atol=1e-6)
    assert sim["stats"] == mesh["stats"]
    expected = 3 if algorithm == "allreduce" else 1 + 1  # diloco: 1 sync and the start check
    assert sim["stats"].collectives == expected
    for out in (sim, mesh):  # step 3 synchronized: every replica holds the same parameters
        model, _ = od.nnx_replica(out["graphdef"], out["state"], None)
        _assert_synchronized(nnx.state(model, nnx.Param), algorithm)


@pytest.mark.parametrize("algorithm", [pytest.param("allreduce", marks=pytest.mark.slow), "diloco"])
def test_linen_trainstate_same_on_simulate_and_mesh(algorithm, monkeypatch):
    ex = _example("linen_trainstate")
    monkeypatch.setattr(ex, "CNN", _SmallLinenCnn)
    kw = dict(steps=3, replicas=N, algorithm=algorithm, batch_size=16, period=3)
    sim, mesh = ex.train(harness="simulate", **kw), ex.train(harness="mesh", **kw)
    assert _max_diff(sim["state"], mesh["state"]) <= 2e-5
    np.testing.assert_allclose(sim["losses"], mesh["losses"], rtol=0, atol=1e-6)
    assert sim["stats"] == mesh["stats"]
    for out in (sim, mesh):  # parameters and BatchNorm statistics were averaged at step 3
        _assert_synchronized(out["state"].params, algorithm)
        od.assert_replicas_identical(out["state"].batch_stats)  # averaged by pmean: exact


class _Mlp(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(12, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.b = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(nnx.relu(self.a(x))))


def _mlp_run(run, algorithm, steps=4, distinct_rngs=True):
    comm = od.AxisComm(od.REPLICA_AXIS)
    tx = (
        optax.chain(od.allreduce(comm=comm), optax.adam(1e-2))
        if algorithm == "allreduce"
        else od.diloco(optax.adam(1e-2), comm=comm, period=2)
    )
    model = _Mlp(nnx.Rngs(0, dropout=1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    graphdef, state = od.nnx_replicate((model, optimizer), N, distinct_rngs=distinct_rngs)

    def train(objects, x, y):
        model, optimizer = objects
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    step = run(od.nnx_step(graphdef, train))
    x = jnp.broadcast_to(jax.random.normal(jax.random.key(2), (8, 12)), (N, 8, 12))  # one batch
    losses = []
    for _ in range(steps):
        state, loss = step(state, x, jnp.tanh(x[..., :3]))
        losses.append(loss)
    return graphdef, state, jnp.stack(losses, 1)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["allreduce", "diloco"])
def test_nnx_dropout_model_same_on_simulate_and_mesh(algorithm):
    """Dropout with per-replica RNG streams draws the same masks on both harnesses (a different
    mask would move the result by far more than the tolerance)."""
    _, sim, sim_loss = _mlp_run(od.simulate, algorithm)
    _, mesh, mesh_loss = _mlp_run(lambda f: od.on_mesh(f, _mesh()), algorithm)
    assert _max_diff((sim, sim_loss), (mesh, mesh_loss)) <= 1e-6


# ---- the helpers --------------------------------------------------------------------------------


def test_nnx_replicate_gives_each_replica_its_own_rng_streams():
    graphdef, state, loss = _mlp_run(od.simulate, "allreduce", steps=1)
    assert len(set(np.asarray(loss[:, 0]).tolist())) == N  # same batch, different dropout masks
    model, optimizer = od.nnx_replica(graphdef, state, None)
    od.assert_replicas_identical(nnx.state(model, nnx.Param))  # all-reduce kept them in sync
    assert od.comm_stats(optimizer.opt_state).collectives == 1

    _, _, same = _mlp_run(od.simulate, "allreduce", steps=1, distinct_rngs=False)
    assert len(set(np.asarray(same[:, 0]).tolist())) == 1


def test_module_docstring_example_runs():
    import textwrap

    import optaxdist.flax

    code = textwrap.dedent(optaxdist.flax.__doc__.split("Example::")[1])
    scope: dict = {}
    exec(compile(code, "optaxdist/flax.py docstring", "exec"), scope)
    stats = od.comm_stats(scope["optimizer"].opt_state)
    assert stats.by_kind == {"all_reduce[float32]": (1, 16)}  # 4 parameters, once


def test_nnx_replica_rebuilds_one_row():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    graphdef, state = od.nnx_replicate(model, 3)
    assert state["kernel"].shape == (3, 2, 3)
    stacked = jax.tree.map(lambda x: x * jnp.arange(1.0, 4.0).reshape((3,) + (1,) * (x.ndim - 1)), state)
    second = od.nnx_replica(graphdef, stacked, 1)
    assert isinstance(second, nnx.Linear)
    np.testing.assert_array_equal(second.kernel[...], 2 * model.kernel[...])


def test_nnx_step_rejects_a_structure_change():
    graphdef, state = od.nnx_replicate(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), 2)

    def grows(model):
        model.extra = nnx.Param(jnp.zeros(()))

    with pytest.raises(ValueError, match="structure"):
        od.simulate(od.nnx_step(graphdef, grows))(state)


# ---- convergence and the scripts ----------------------------------------------------------------


def test_nnx_mnist_converges():
    """150 steps of all-reduce + Adam, 4 replicas: measured 0.930-0.938 (seeds 0, 1; DiLoCo and the
    linen example 0.924-0.946). A model that does not learn stays near 0.1."""
    out = _example("nnx_mnist").train(steps=150, replicas=N, algorithm="allreduce", seed=1)
    assert out["accuracy"] > 0.88
    assert np.mean(out["losses"][-10:]) < 0.5 * np.mean(out["losses"][:10])


def _script(args: list[str]) -> str:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow  # its train() runs in the default run (the CNN and convergence tests above)
def test_nnx_example_script_runs():
    out = _script(["examples/nnx_mnist.py", "--steps", "20", "--algorithm", "diloco", "--period", "5"])
    assert "test accuracy (replica 0)" in out
    assert "sent per replica: 5 collectives" in out  # 4 syncs and the start check


@pytest.mark.slow
def test_linen_example_script_runs_on_mesh():
    out = _script(["examples/linen_trainstate.py", "--steps", "20", "--harness", "mesh"])
    assert "sent per replica: 20 collectives" in out


def test_nnx_checkpoint_with_its_graphdef_refuses_another_ledger(tmp_path):
    """``nnx.State`` flattens the optimizer state's classes and ledgers away: with the graphdef
    the checkpoint keeps them, and a run whose ledger differs (another wire dtype) is refused."""
    import orbax.checkpoint as ocp

    def replicated(dtype):
        model = _Mlp(nnx.Rngs(0))
        tx = od.diloco(optax.adam(1e-2), comm=od.AxisComm(od.REPLICA_AXIS), period=3, dtype=dtype)
        return od.nnx_replicate((model, nnx.Optimizer(model, tx, wrt=nnx.Param)), N)

    graphdef, state = replicated(None)
    with ocp.CheckpointManager(tmp_path) as manager:
        od.save_checkpoint(manager, 1, state, graphdef=graphdef)
        manager.wait_until_finished()
        same_graphdef, same = replicated(None)  # built again: describes alike
        restored = od.restore_checkpoint(manager, 1, same, graphdef=same_graphdef)
        np.testing.assert_array_equal(jax.tree.leaves(restored)[0], jax.tree.leaves(state)[0])
        other_graphdef, other = replicated("bfloat16")
        assert jax.tree.structure(other) == jax.tree.structure(state)  # the state alone can't tell
        with pytest.raises(od.CheckpointMismatchError, match=r"CommLedger\[\(\('all_reduce\[float32\]'"):
            od.restore_checkpoint(manager, 1, other, graphdef=other_graphdef)
    with pytest.raises(TypeError, match="graphdef must be a flax.nnx GraphDef"):
        od.save_checkpoint(None, 1, state, graphdef=object())
