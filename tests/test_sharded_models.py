"""Every public transform on replicas whose parameters are sharded over a model axis.

``on_mesh(step, mesh, axis_name=...)`` is manual over the replica axes only; the other mesh axes
(``"model"``) are the compiler's. Each transform, run for a few steps (past the first sync of the
periodic ones) on ``("replica", "model")`` meshes of 4×2 and 2×4, and the hierarchical ones on a
``("node", "local", "model")`` mesh of 2×2×2, must give the numbers of ``simulate`` and leave the
parameters, and every per-replica state leaf shaped like a kernel, sharded over ``"model"``.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist as od
from optaxdist.bench.data import random_normal
from tests.test_contract import TRANSFORMS as CONTRACT

R = od.REPLICA_AXIS
M = "model"
COMM = od.AxisComm(R)
STEPS = 4
# kernels split over the model axis, on their second and first dimension; the bias replicated
SPECS = {"w1": (None, M), "w2": (M, None), "b": (None,)}


def _sgd():
    return optax.sgd(0.1)


def _momentum():
    return optax.sgd(0.1, momentum=0.9)


# name -> factory(comm, n): a transform run by `step`. Gradient transforms are chained with SGD.
TRANSFORMS = {
    "allreduce": lambda c, n: optax.chain(od.allreduce(comm=c), _sgd()),
    "allreduce_bf16_sum": lambda c, n: optax.chain(
        od.allreduce(comm=c, op="sum", dtype="bfloat16", divide_before=True), _sgd()
    ),
    "allreduce_fp16_clip": lambda c, n: optax.chain(
        od.allreduce(comm=c, dtype="float16", clip_value=10.0), _sgd()
    ),
    "average_params": lambda c, n: optax.chain(_momentum(), od.average_params(comm=c)),
    "dynamic_loss_scale": lambda c, n: od.dynamic_loss_scale(
        optax.chain(od.allreduce(comm=c), _sgd()), comm=c
    ),
    "dynamic_loss_scale_backoff": lambda c, n: od.dynamic_loss_scale(_sgd(), comm=c, growth_interval=2),
    "mlbench_loss_scale": lambda c, n: od.mlbench_loss_scale(_sgd(), comm=c),
    "skip_nonfinite": lambda c, n: od.skip_nonfinite(_momentum(), comm=c),
    "compressed_top_k": lambda c, n: optax.chain(
        od.compressed_allreduce(od.compress.top_k(fraction=0.25), comm=c), _sgd()
    ),
    "compressed_sign_model": lambda c, n: optax.chain(
        od.compressed_allreduce(od.compress.sign(scaled=True), comm=c, scope="model"), _sgd()
    ),
    "compressed_random_k_no_ef": lambda c, n: optax.chain(
        od.compressed_allreduce(od.compress.random_k(count=4), comm=c, error_feedback=False), _sgd()
    ),
    "exact_warmup": lambda c, n: optax.chain(
        od.exact_warmup(od.compressed_allreduce(od.compress.cast("float16"), comm=c), comm=c, warmup_steps=1),
        _sgd(),
    ),
    "powersgd": lambda c, n: optax.chain(od.powersgd(comm=c, rank=2, warmup_steps=1), _sgd()),
    "local_sgd": lambda c, n: od.local_sgd(
        _momentum(), comm=c, period=2, warmup_steps=1, average_inner_state=True
    ),
    "des_loc": lambda c, n: od.des_loc(_momentum(), comm=c, period=1, state_periods={"trace": 2}),
    "diloco": lambda c, n: od.diloco(_sgd(), comm=c, period=2),
    "sparseloco": lambda c, n: od.sparseloco(_sgd(), comm=c, period=2, chunk_size=16, k=4),
    "slowmo_memory_efficient": lambda c, n: od.slowmo(
        _sgd(), comm=c, learning_rate=0.1, period=2, num_shards=n, anchor_after_first_step=True
    ),
    "partial_average": lambda c, n: od.partial_average(_momentum(), comm=c, partitions=((0,), (1, 2))),
    "streaming_diloco": lambda c, n: od.streaming_diloco(_sgd(), comm=c, period=2, num_fragments=2),
    "streaming_diloco_overlap": lambda c, n: od.streaming_diloco(
        _sgd(), comm=c, period=4, num_fragments=2, delay=1, blend=0.5, overlap=True
    ),
    "decentralized_sgd": lambda c, n: od.decentralized_sgd(_momentum(), comm=c, topology=od.topology.ring(n)),
    "sgp_overlap": lambda c, n: od.sgp(
        _sgd(), comm=c, topology=od.topology.ring(n, directed=True), overlap=True, average_period=2
    ),
    "daso": lambda c, n: od.daso(
        _momentum(),
        local_comm=c,
        cross_comm=c,
        steps_per_epoch=2,
        total_epochs=3,
        warmup_epochs=1,
        cooldown_epochs=0,
    ),
    "daso_heat": lambda c, n: od.daso(
        _sgd(),
        local_comm=c,
        cross_comm=c,
        steps_per_epoch=1,
        total_epochs=3,
        warmup_epochs=0,
        cooldown_epochs=0,
        downcast=None,
        heat_quirks=od.HeatQuirks.all(),
    ),
    "sign_sgd": lambda c, n: od.sign_sgd(0.1, momentum=0.9),
    "demo": lambda c, n: od.demo(0.1, comm=c, chunk_size=4, k=3, sign=False, weight_decay=0.01),
    "averaged_iterate": lambda c, n: optax.chain(_sgd(), od.averaged_iterate(shift=3.0)),
    "singa_sgd": lambda c, n: od.singa_sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3),
}

# Wire dtypes narrower than the parameters round the gradients (DASO sends bfloat16 by default):
# where the mesh sums a model-split dot product in another order than vmap, a value next to a
# rounding boundary can round to the neighbouring float16 / bfloat16 value (one ulp of the wire
# dtype), and later steps carry it on. The parameters move by 4e-2 to 2e-1 in these steps.
TOLERANCE = {"allreduce_fp16_clip": 1e-4, "allreduce_bf16_sum": 3e-4, "daso": 3e-4}

# one of each family in the default run (DASO: the hierarchical test; PowerSGD over a model axis:
# tests/test_sharded_compression.py; the all-reduce inside dynamic loss scaling), the rest under
# -m slow
DEFAULT = {
    (4, "dynamic_loss_scale"),
    (4, "compressed_top_k"),
    (4, "singa_sgd"),
    (2, "sgp_overlap"),
}
SLOW = pytest.mark.slow


def test_every_public_transform_is_covered():
    assert set(CONTRACT) <= set(TRANSFORMS)


# ---- the problem ---------------------------------------------------------------------------------


def _problem(n: int):
    """Stacked params of ``n`` identical replicas, and different data per replica."""
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = {
        "w1": random_normal(k1, (8, 16)) * 0.3,
        "w2": random_normal(k2, (16, 8)) * 0.3,
        "b": jnp.full((8,), 0.1),
    }
    x = random_normal(k3, (STEPS, n, 4, 8))
    y = jnp.tanh(random_normal(k4, (STEPS, n, 4, 8)))
    return od.replicate(params, n), x, y


def _loss(p, x, y):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["b"] - y) ** 2)


def _make_step(tx):
    def step(p, s, x, y):
        loss, g = jax.value_and_grad(_loss)(p, x, y)
        u, s = tx.update(g, s, p, value=loss)
        return optax.apply_updates(p, u), s

    return step


def _run(wrap, tx, params, x, y):
    """``init`` then ``STEPS`` steps, each call of ``wrap``ped functions compiled once; the final
    parameters and state, and the state from ``init``."""
    initial = state = wrap(tx.init)(params)
    step = wrap(_make_step(tx))
    for t in range(STEPS):
        params, state = step(params, state, x[t], y[t])
        if t == 0:
            _assert_placed_alike(initial, state)
    return params, state, initial


@functools.cache
def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def _place(params, mesh, replica_axes):
    lead = replica_axes if len(replica_axes) > 1 else replica_axes[0]
    return {k: jax.device_put(v, NamedSharding(mesh, P(lead, *SPECS[k]))) for k, v in params.items()}


def _dims(spec, ndim):
    """``spec`` as one entry per dimension (trailing ``None`` filled in), axes as tuples."""
    out = list(spec) + [None] * (ndim - len(spec))
    return tuple(() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in out)


def _assert_model_sharded(params, state, replica_axes):
    """The kernels, and every state leaf shaped like a kernel, still split over ``"model"``."""
    want = {}
    for k, v in params.items():
        if M in SPECS[k]:
            want[v.shape] = (tuple(replica_axes),) + _dims(SPECS[k], v.ndim - 1)
    assert len(want) == 2
    checked = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path((params, state)):
        if getattr(leaf, "shape", None) in want:
            spec = _dims(leaf.sharding.spec, leaf.ndim)
            assert spec == want[leaf.shape], (jax.tree_util.keystr(path), leaf.sharding.spec)
            checked += 1
    return checked


def _assert_placed_alike(initial, stepped):
    """Every state leaf that ``init`` split over ``"model"`` the step returns split the same way."""
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(initial), jax.tree.leaves(stepped)):
        if isinstance(a.sharding, NamedSharding) and M in jax.tree.leaves(tuple(a.sharding.spec)):
            got, want = _dims(a.sharding.spec, a.ndim), _dims(b.sharding.spec, b.ndim)
            assert got == want, (jax.tree_util.keystr(path), a.sharding.spec, b.sharding.spec)


def _compare(want, got, start, tol=1e-5):
    moved = False
    for (path, a), b, s in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got), jax.tree.leaves(start)
    ):
        a, b = np.asarray(a), np.asarray(b)
        np.testing.assert_allclose(b, a, atol=tol, rtol=tol, err_msg=jax.tree_util.keystr(path))
        moved |= not np.allclose(a, np.asarray(s))
    assert moved, "the parameters never moved: the comparison proves nothing"


# ---- flat ("replica", "model") meshes --------------------------------------------------------------


@pytest.mark.parametrize(
    "n,name",
    [
        pytest.param(
            n, name, marks=() if (n, name) in DEFAULT else pytest.mark.slow, id=f"{n}x{8 // n}-{name}"
        )
        for n in (4, 2)
        for name in sorted(TRANSFORMS)
    ],
)
def test_model_sharded_replicas_match_simulate(n, name):
    tx = TRANSFORMS[name](COMM, n)
    params, x, y = _problem(n)
    want, want_state, _ = _run(od.simulate, tx, params, x, y)

    mesh = _mesh((n, 8 // n), (R, M))
    start = _place(params, mesh, (R,))
    got, state, initial = _run(lambda f: od.on_mesh(f, mesh, axis_name=R), tx, start, x, y)

    _compare((want, want_state), (got, state), (params, want_state), TOLERANCE.get(name, 1e-5))
    assert _assert_model_sharded(got, state, (R,)) >= 2
    assert _assert_model_sharded(start, initial, (R,)) == _assert_model_sharded(got, state, (R,))


# ---- hierarchical: ("node", "local", "model") ------------------------------------------------------

HIERARCHICAL = {
    "daso": lambda h: od.daso(
        _momentum(),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=2,
        total_epochs=3,
        warmup_epochs=1,
        cooldown_epochs=0,
        first_cycle=(2, 1, 1),
    ),
    "hierarchical_local_sgd": lambda h: od.local_sgd(
        _momentum(), comm=h.world, period=4, local_comm=h.local, local_period=2, average_inner_state=True
    ),
}


# DASO runs in the full set only (the slowest case; hierarchical local SGD represents the family)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "daso" else n for n in sorted(HIERARCHICAL)]
)
def test_hierarchical_model_sharded_replicas_match_simulate(name):
    nodes, local = 2, 2
    tx = HIERARCHICAL[name](od.axis_hierarchy(nodes, local))
    params, x, y = _problem(nodes * local)
    axes = ("node", "local")
    want, want_state, _ = _run(
        lambda f: od.simulate(f, axis_name=axes, shape=(nodes, local)), tx, params, x, y
    )

    mesh = _mesh((nodes, local, 2), (*axes, M))
    start = _place(params, mesh, axes)
    got, state, initial = _run(lambda f: od.on_mesh(f, mesh, axis_name=axes), tx, start, x, y)

    _compare((want, want_state), (got, state), (params, want_state), TOLERANCE.get(name, 1e-5))
    assert _assert_model_sharded(got, state, axes) >= 2
    assert _assert_model_sharded(start, initial, axes) == _assert_model_sharded(got, state, axes)


# ---- the memory-efficient outer mode (num_shards) under model sharding -----------------------------

MEMORY_EFFICIENT = {
    "diloco": lambda ms, n: od.diloco(_sgd(), comm=COMM, period=2, num_shards=n, model_sharding=ms),
    "streaming_diloco": lambda ms, n: od.streaming_diloco(
        _momentum(), comm=COMM, period=2, num_fragments=2, num_shards=n, model_sharding=ms
    ),
}


@pytest.mark.parametrize(
    "name", [pytest.param(k, marks=() if k == "diloco" else SLOW) for k in sorted(MEMORY_EFFICIENT)]
)
def test_memory_efficient_outer_sync_keeps_blocks_split_over_the_model_axis(name):
    """Each device reduce-scatters its own blocks: the numbers of the unsharded memory-efficient
    run, no leaf gathered over the model axis, the anchor blocks split over it (1/(W·D) of the
    kernels per device), and the ledger's reduce-scatter = the HLO's over the replica axis."""
    from tests.test_sharded_compression import collectives_by_axis

    n = 4
    mesh = _mesh((n, 8 // n), (R, M))
    sharding = od.ModelSharding.from_mesh(mesh, {k: P(*v) for k, v in SPECS.items()}, R)
    tx = MEMORY_EFFICIENT[name](sharding, n)
    params, x, y = _problem(n)
    plain, _, _ = _run(od.simulate, MEMORY_EFFICIENT[name](None, n), params, x, y)
    want, want_state, _ = _run(od.simulate, tx, params, x, y)
    _compare(plain, want, params)

    start = _place(params, mesh, (R,))
    got, state, initial = _run(lambda f: od.on_mesh(f, mesh, axis_name=R), tx, start, x, y)
    _compare((want, want_state), (got, state), (params, want_state))
    assert _assert_model_sharded(got, state, (R,)) >= 2
    assert _assert_model_sharded(start, initial, (R,)) == _assert_model_sharded(got, state, (R,))

    # per fragment, one block per group of its leaves: the kernels' split over "model", the bias's not
    blocks = [b for fragment in state.sync_state.anchors for b in fragment]
    split = [b for b in blocks if M in b.sharding.spec]
    whole = [b for b in blocks if M not in b.sharding.spec]
    assert split and all(b.sharding.spec == P(R, M) for b in split)
    assert all({s.data.shape for s in b.addressable_shards} == {(1, b.shape[1] // 2)} for b in split)
    assert all(b.sharding.spec in (P(R), P(R, None)) and b.shape[1] <= 2 for b in whole)

    update = od.on_mesh(lambda g, s, p: tx.update(g, s, p), mesh, axis_name=R)
    text = update.lower(got, state, got).compile().as_text()  # the transform's, not the model's
    by_axis = collectives_by_axis(text, mesh)
    assert all(nbytes <= 8 for _, nbytes in by_axis["model"]), by_axis["model"]  # flags only
    # each group's reduce-scatter appears once per branch of the engine that syncs its fragment
    scattered = collections.Counter(b for op, b in by_axis["replica"] if op == "reduce-scatter")
    copies = min(scattered.values())
    assert all(c % copies == 0 for c in scattered.values()), scattered
    kinds = zip(state.ledger.kinds, state.ledger.payloads)
    ledger = sum(p for k, p in kinds if k.collective == "reduce_scatter")
    # each of a replica's 2 devices scatters its blocks: its input is 4 replicas × its result
    assert ledger * copies == 2 * n * sum(b * c for b, c in scattered.items())
