"""Zero-cost local steps, checked on the program's structure (not timed).

For every transform that synchronizes on a schedule, the step traced under ``simulate`` (vmap) and
under ``on_mesh`` (shard_map) runs its collectives only inside ``lax.cond``/``lax.switch``
branches: outside them there is no collective on floating-point data, no host callback and no
parameter-sized ``select`` — with the non-finite guard off and on (its selects run in a ``cond``
taken only when some replica's update is not finite). Under vmap a ``cond`` whose predicate is
batched turns into a ``select`` that runs every branch, so this fails unless the schedule's
predicates are replica-uniform (``Communicator.uniform``).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist import topology

N = 4
BRANCHING = {"cond"}
COLLECTIVES = {"psum", "psum2", "psum_invariant", "all_gather", "all_gather_invariant", "ppermute"}
COLLECTIVES |= {"psum_scatter", "reduce_scatter", "all_to_all", "pmax", "pmin"}
CALLBACKS = {"debug_callback", "io_callback", "pure_callback"}


def _sub_jaxprs(eqn) -> Iterator[jax.extend.core.Jaxpr]:
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def unconditional_eqns(jaxpr) -> Iterator:
    """Equations that run on every step: everything outside the branches of a cond/switch."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name in BRANCHING:
            continue
        for sub in _sub_jaxprs(eqn):
            yield from unconditional_eqns(sub)


def branch_eqns(jaxpr) -> Iterator:
    """Equations inside the branches of any cond/switch."""
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn):
            if eqn.primitive.name in BRANCHING:
                yield from _all_eqns(sub)
            else:
                yield from branch_eqns(sub)


def _all_eqns(jaxpr) -> Iterator:
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _all_eqns(sub)


def _is_float_collective(eqn) -> bool:
    return eqn.primitive.name in COLLECTIVES and any(
        jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.invars if hasattr(v, "aval")
    )


def params_tree():
    return {"w": jnp.linspace(-1.0, 1.0, 64 * 8).reshape(64, 8), "b": jnp.linspace(0.0, 1.0, 32)}


MIN_PARAM_SIZE = 32  # every parameter leaf has at least this many elements per replica


def _daso(nonfinite):
    h = od.axis_hierarchy(2, 2)
    return od.daso(
        optax.sgd(0.1, momentum=0.9),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=8,
        total_epochs=4,
        warmup_epochs=0,
        nonfinite=nonfinite,
    )


def make(name: str, nonfinite: str, comm):
    inner = optax.sgd(0.1, momentum=0.9)
    kw = dict(comm=comm, nonfinite=nonfinite)
    return {
        "local_sgd": lambda: od.local_sgd(inner, period=30, warmup_steps=2, **kw),
        "diloco": lambda: od.diloco(inner, period=30, **kw),
        "slowmo": lambda: od.slowmo(inner, period=30, learning_rate=0.1, **kw),
        "streaming_diloco": lambda: od.streaming_diloco(inner, period=30, num_fragments=2, delay=3, **kw),
        "partial_average": lambda: od.partial_average(inner, partitions=((0,), (1,)), **kw),
        "decentralized_sgd": lambda: od.decentralized_sgd(
            inner, topology=topology.ring(N), average_period=10, **kw
        ),
        "sgp": lambda: od.sgp(inner, topology=topology.ring(N), average_period=10, **kw),
        "daso": lambda: _daso(nonfinite),
    }[name]()


PERIODIC = [
    "local_sgd",
    "diloco",
    "slowmo",
    "streaming_diloco",
    "partial_average",
    "decentralized_sgd",
    "sgp",
    "daso",
]


def traced_step(name: str, harness: str, nonfinite: str):
    hierarchical = name == "daso"
    comm = od.AxisComm(("node", "local") if hierarchical else od.REPLICA_AXIS)
    tx = make(name, nonfinite, comm)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params, value=jnp.sum(grads["b"]))
        return optax.apply_updates(params, updates), state

    params = od.replicate(params_tree(), N)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, params)
    if harness == "simulate":
        kw = dict(axis_name=("node", "local"), shape=(2, 2)) if hierarchical else {}
        state = od.simulate(tx.init, **kw)(params)
        run = od.simulate(step, **kw)
    else:
        shape, axes = ((2, 2), ("node", "local")) if hierarchical else ((N,), (od.REPLICA_AXIS,))
        auto = (jax.sharding.AxisType.Auto,) * len(axes)
        mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:N], axis_types=auto)
        state = od.on_mesh(tx.init, mesh)(params)
        run = od.on_mesh(step, mesh)
    return jax.make_jaxpr(run)(params, state, grads).jaxpr


@pytest.mark.parametrize("nonfinite", ["ignore", "skip"])
@pytest.mark.parametrize("where", ["simulate", "mesh"])
@pytest.mark.parametrize("name", PERIODIC)
def test_local_step_runs_no_collective_outside_a_branch(name, where, nonfinite):
    jaxpr = traced_step(name, where, nonfinite=nonfinite)
    top = list(unconditional_eqns(jaxpr))
    names = [e.primitive.name for e in top]
    assert not [e for e in top if _is_float_collective(e)], (name, where, names)
    assert not CALLBACKS & set(names), (name, where)
    big_selects = [
        e
        for e in top
        if e.primitive.name == "select_n" and int(np.prod(e.outvars[0].aval.shape)) >= MIN_PARAM_SIZE
    ]
    assert not big_selects, [str(e.outvars[0].aval) for e in big_selects]
    # the collectives exist, inside the branches (so this test can see them)
    inside = [e.primitive.name for e in branch_eqns(jaxpr)]
    assert COLLECTIVES & set(inside), (name, where)
    assert "pure_callback" in inside or name == "daso"  # the one-time start check


def test_nonfinite_policy_is_validated():
    with pytest.raises(ValueError, match=r"nonfinite='drop'; allowed: \('skip', 'ignore'\)"):
        od.local_sgd(optax.sgd(0.1), comm=od.AxisComm("replica"), period=2, nonfinite="drop")


def test_uniform_unbatches_under_vmap_and_adds_nothing_on_a_mesh():
    comm = od.AxisComm(od.REPLICA_AXIS)
    counters = jnp.full((N,), 7, jnp.int32)
    jaxpr = jax.make_jaxpr(od.simulate(lambda t: comm.uniform(t) + 0, jit=False))(counters)
    assert "pmax" in str(jaxpr)
    mesh = jax.make_mesh((N,), (od.REPLICA_AXIS,), devices=jax.devices()[:N])
    jaxpr = jax.make_jaxpr(od.on_mesh(lambda t: comm.uniform(t) + 0, mesh))(counters)
    assert "pmax" not in str(jaxpr)
    assert np.asarray(od.simulate(lambda t: comm.uniform(t))(counters)).tolist() == [7] * N


def test_all_finite_reads_every_element():
    """The guard's check: a NaN or an infinity in any floating leaf (16-bit ones included) is not
    finite; finite values are, even where their float32 sum would overflow; integer leaves, empty
    leaves and an empty tree do not count."""
    from optaxdist.transforms._checks import all_finite

    big = jnp.full((4,), 3e38, jnp.float32)  # finite; its sum is not
    assert bool(all_finite({"a": big, "b": jnp.ones((3,), jnp.bfloat16)}))
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
        for bad in (jnp.nan, jnp.inf, -jnp.inf):
            leaf = jnp.zeros((5,), dtype).at[3].set(bad)
            assert not bool(all_finite({"ok": big, "bad": leaf})), (dtype, bad)
    assert bool(all_finite({"n": jnp.arange(3), "e": jnp.zeros((0,), jnp.float32)}))
    assert bool(all_finite({}))


@pytest.mark.parametrize("where", ["simulate", "mesh"])
def test_the_nonfinite_guard_selects_only_when_an_update_is_not_finite(where):
    """The guard of ``nonfinite="skip"`` reads the update (``all_finite``) on every step; its
    parameter-sized selects sit in a ``cond`` taken only when some replica's update is not finite."""
    from optaxdist.accounting import per_replica
    from optaxdist.transforms._checks import local_step

    comm = od.AxisComm(od.REPLICA_AXIS)
    inner = optax.with_extra_args_support(optax.sgd(0.1, momentum=0.9))

    def step(params, state, grads):
        kw = dict(nonfinite="skip", uniform=comm.uniform, vary=lambda t: per_replica(t, comm))
        return local_step(inner, grads, state, params, **kw)

    params = od.replicate(params_tree(), N)
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.01, params)
    state = od.simulate(inner.init)(params)
    if where == "simulate":
        run = od.simulate(step)
    else:
        mesh = jax.make_mesh((N,), (od.REPLICA_AXIS,), devices=jax.devices()[:N])
        run = od.on_mesh(step, mesh)
    jaxpr = jax.make_jaxpr(run)(params, state, grads).jaxpr
    selects = lambda eqns: [
        e for e in eqns if e.primitive.name == "select_n" and e.outvars[0].aval.size >= 32
    ]
    assert not selects(unconditional_eqns(jaxpr))
    assert selects(branch_eqns(jaxpr))  # the guard exists
    # and it still skips: a replica whose gradient is not finite keeps its state, the others step
    bad = jax.tree.map(lambda g: g.at[1].set(jnp.nan), grads)
    updates, new_state = run(params, state, bad)
    w, trace, before = (np.asarray(x) for x in (updates["w"], new_state[0].trace["w"], state[0].trace["w"]))
    assert np.all(w[1] == 0) and np.all(np.isfinite(w)) and np.all(w[0] != 0)
    np.testing.assert_array_equal(trace[1], before[1])
