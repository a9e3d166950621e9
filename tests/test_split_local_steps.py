"""``split_local_steps=True``: the local steps of periodic transforms as a program of their own.

The harness runs the local program only on the calls where every periodic update is a plain local
step, and there it computes what the general program computes, up to how XLA compiles the same
operations: the local program may fuse ``params + updates`` into a fused multiply-add where the
general program rounds the update first (it crosses the schedule's ``switch``), or evaluate Adam's
bias correction in another fusion. With momentum SGD at learning rates that are powers of two no
product rounds, and the runs are compared bit for bit; with Adam, to a rounding per step (a
synchronization run by the local program would be off by far more).
"""

from __future__ import annotations

import functools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist as od
from optaxdist import topology
from optaxdist.bench.data import random_normal
from optaxdist.parallel.split import LOCAL

N = 4
STEPS = 40
LR = 0.125
REPLICA = od.REPLICA_AXIS


def _momentum() -> optax.GradientTransformation:
    return optax.sgd(LR, momentum=0.5)


def _adam() -> optax.GradientTransformation:
    return optax.adam(LR)


def _outer() -> optax.GradientTransformation:
    """DiLoCo's outer optimizer with factors that are powers of two (no product rounds)."""
    return optax.sgd(0.5, momentum=0.5, nesterov=True)


# (transform, the calls out of STEPS that run the local program, bit-exact): every call but the
# synchronizations, the start check's first step, the warm-up, the first step after it (DiLoCo's
# anchors), and the first call (the general program is traced first, then the counters are read)
CASES = {
    # syncs at t = 6, 13, ..., 34 (5) and the local level at odd t not already synced
    "local_sgd": (
        lambda comm, nf: od.local_sgd(_momentum(), comm=comm, period=7, nonfinite=nf),
        STEPS - 5 - 1,
        True,
    ),
    # warm-up 0..2, anchors at 3, syncs at s = 4, 9, ..., 34 (t = 7, ..., 37: 7)
    "diloco": (
        lambda comm, nf: od.diloco(
            _momentum(), comm=comm, period=5, warmup_steps=3, outer=_outer(), nonfinite=nf
        ),
        STEPS - 3 - 1 - 7,
        True,
    ),
    "slowmo": (
        lambda comm, nf: od.slowmo(_momentum(), comm=comm, period=8, learning_rate=0.5, nonfinite=nf),
        STEPS - 1 - 5,
        True,
    ),
    # fragments sync at s = 2, 5, 8, ... (period 6, 2 fragments: every 3 steps; 13), merged 1 later
    "streaming_diloco": (
        lambda comm, nf: od.streaming_diloco(
            _momentum(), comm=comm, period=6, num_fragments=2, delay=1, outer=_outer(), nonfinite=nf
        ),
        STEPS - 1 - 13 - 13,
        True,
    ),
    # parameters every 4 steps (10), the first moment every 8 (at the same steps)
    "des_loc": (
        lambda comm, nf: od.des_loc(_adam(), comm=comm, period=4, state_periods={"mu": 8}, nonfinite=nf),
        STEPS - 1 - 10,
        False,
    ),
    "decentralized_sgd": (
        lambda comm, nf: od.decentralized_sgd(
            _momentum(), comm=comm, topology=topology.ring(N), nonfinite=nf
        ),
        0,
        True,
    ),
}


def _params():
    return od.replicate({"w": jnp.linspace(-1.0, 1.0, 24).reshape(6, 4), "b": jnp.zeros((4,))}, N)


def _grads(steps: int = STEPS):
    keys = jax.random.split(jax.random.key(0), steps)
    like = _params()
    return [jax.tree.map(lambda p, k=k: random_normal(k, p.shape), like) for k in keys]


def _step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state

    return step


def _loss_step(tx):
    """DASO's step: the loss goes to its plateau detector."""

    def step(params, state, grads, loss):
        updates, state = tx.update(grads, state, params, value=loss)
        return od.apply_updates(params, updates, state), state

    return step


def _small_daso():
    """DASO on 2 nodes of 2 (an epoch of 4 steps, ended in the general program) and its harness."""
    h = od.axis_hierarchy(2, 2)
    tx = od.daso(
        _momentum(),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=4,
        total_epochs=3,
        warmup_epochs=1,
        cooldown_epochs=0,
        nonfinite="ignore",
    )
    return tx, functools.partial(od.simulate, axis_name=("node", "local"), shape=(2, 2))


def _run(run, tx, grads, params=None, state=None):
    params = _params() if params is None else params
    state = od.simulate(tx.init)(params) if state is None else state
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
        for g in grads:
            params, state = run(params, state, g)
    return params, state


def _assert_same_bits(a, b, exact: bool = True):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        if exact or not jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
        else:
            np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)


# the default non-finite guard for every transform (in the full run: SlowMo, DiLoCo's outer step
# with another outer optimizer; gossip, which runs a synchronization's program on every step; and
# Streaming DiLoCo, whose fragments' programs test_synchronizations_beyond_the_limit_... runs);
# without it (the local program then fuses the update with ``params + updates``) local SGD, and the
# others in the full run
SLOW_GUARDED = ("slowmo", "decentralized_sgd", "streaming_diloco")
SLOW = pytest.mark.slow
GUARDS = [pytest.param(name, "skip", marks=SLOW if name in SLOW_GUARDED else ()) for name in sorted(CASES)]
GUARDS += [pytest.param(name, "ignore", marks=() if name == "local_sgd" else SLOW) for name in sorted(CASES)]


@pytest.mark.parametrize("name, nonfinite", GUARDS)
def test_split_runs_the_local_program_on_local_steps_and_computes_the_same(name, nonfinite):
    build, local_calls, exact = CASES[name]
    tx = build(od.AxisComm(REPLICA), nonfinite)
    grads = _grads()
    expected = _run(od.simulate(_step(tx), donate_argnums=(0, 1)), tx, grads)
    split = od.simulate(_step(tx), donate_argnums=(0, 1), split_local_steps=True)
    got = _run(split, tx, grads)
    _assert_same_bits(expected, got, exact)
    assert split.local_calls == local_calls
    general = 3 + 1 if name == "diloco" else 1  # the warm-up and the anchors, else the start check
    assert split.sync_calls == STEPS - local_calls - general


@pytest.mark.parametrize("name", ["local_sgd", pytest.param("des_loc", marks=pytest.mark.slow)])
def test_non_finite_gradients_are_skipped_in_the_local_program(name):
    """The local program's guard (selects, no conditional) skips what the general program's
    skips: a replica's NaN gradient on one local step, another's infinite one on the next."""
    build, _, exact = CASES[name]
    tx = build(od.AxisComm(REPLICA), "skip")
    grads = _grads(8)
    for t, replica, bad in ((2, 1, jnp.nan), (3, N - 1, jnp.inf)):
        grads[t] = {**grads[t], "w": grads[t]["w"].at[replica, 0, 0].set(bad)}
        assert not np.isfinite(np.asarray(grads[t]["w"][replica, 0, 0]))
    expected = _run(od.simulate(_step(tx)), tx, grads)
    split = od.simulate(_step(tx), split_local_steps=True)
    got = _run(split, tx, grads)
    assert split.local_calls >= 4
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(got[0]))
    _assert_same_bits(expected, got, exact)


def test_the_guard_runs_an_inner_collective_once():
    """The local program's guard computes the update a second time (so that its sums need not
    write it to memory) only where the inner update sends nothing: an inner that all-reduces
    (a node-level average in a hierarchy) all-reduces once per local step, as a plain step."""
    mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
    inner = optax.chain(od.allreduce(comm=od.AxisComm(REPLICA)), optax.sgd(0.1))
    tx = od.local_sgd(inner, comm=od.AxisComm(REPLICA), period=5)
    split = od.on_mesh(_step(tx), mesh, donate_argnums=(0, 1), split_local_steps=True)
    params, state = _params(), od.on_mesh(tx.init, mesh)(_params())
    grads = _grads(3)
    for g in grads:
        params, state = split(params, state, g)
    assert split.local_calls == 2
    ours = split.lower_local(params, state, grads[0]).compile().as_text()
    plain = od.on_mesh(_step(inner), mesh).lower(params, state.inner_state, grads[0]).compile().as_text()

    # XLA combines all-reduces into one: count the arrays they reduce
    def reduced(hlo: str) -> int:
        lines = [line for line in hlo.splitlines() if " all-reduce(" in line]
        return sum(line.split(" all-reduce(")[0].count("[") for line in lines)

    assert reduced(ours) == reduced(plain) == 2


def test_the_guard_computes_the_update_once_before_a_synchronization():
    """The local program's guard computes the update a second time, behind a barrier (its check
    then need not write the update to memory); a synchronization's program writes the update
    anyway, for the average, and computes it once (a second pass there cost 10-20 % of a step at
    64 × 100k: docs/benchmarks.md)."""
    tx = od.local_sgd(_momentum(), comm=od.AxisComm(REPLICA), period=3)
    split = od.simulate(_step(tx), split_local_steps=True)
    params, state = _params(), od.simulate(tx.init)(_params())
    grads = _grads(3)
    for g in grads:  # t = 0 the start check, t = 1 a local step, t = 2 a synchronization
        params, state = split(params, state, g)
    assert (split.local_calls, split.sync_calls) == (1, 1)
    (sync,) = split._syncs.values()

    def barriers(program: Any) -> int:
        return str(program.trace(params, state, grads[0]).jaxpr).count("optimization_barrier")

    assert barriers(split.local_program) == 1 and barriers(sync) == 0


def test_a_state_from_elsewhere_is_read_again():
    """A state that is not the previous call's result (a restored checkpoint, the same state
    twice) has its counters read from the device: the schedule stays right."""
    tx = CASES["local_sgd"][0](od.AxisComm(REPLICA), "skip")
    grads = _grads(20)
    plain, split = od.simulate(_step(tx)), od.simulate(_step(tx), split_local_steps=True)
    params, state = _run(plain, tx, grads[:12])  # counter 12: the next sync is at 13
    saved = jax.tree.map(np.asarray, (params, state))  # as a checkpoint holds it
    for run in (plain, split):
        _run(run, tx, grads[:5])  # the split step's counters are elsewhere now
    expected = _run(plain, tx, grads[12:], *saved)
    _assert_same_bits(expected, _run(split, tx, grads[12:], *saved))
    # the same state twice: both calls are at counter 12 (local), then 13 (a sync) and on
    again = [split(*saved, grads[12]) for _ in range(2)]
    _assert_same_bits(again[0], again[1])
    _assert_same_bits(again[0], plain(*saved, grads[12]))


def test_interleaved_runs_are_counted_without_reading(monkeypatch):
    """Two runs of one step, called in turn (a training run and its evaluation, two seeds), are
    each counted on the host: their counters are read once, at their first call, and each runs
    the schedule it would run alone."""
    from optaxdist.parallel import split as split_module

    tx = CASES["local_sgd"][0](od.AxisComm(REPLICA), "ignore")
    grads = _grads(10)
    reads = []
    host_counters = split_module._host_counters
    monkeypatch.setattr(split_module, "_host_counters", lambda xs: reads.append(len(xs)) or host_counters(xs))
    split = od.simulate(_step(tx), split_local_steps=True)
    runs = [(_params(), od.simulate(tx.init)(_params())) for _ in range(2)]
    for g in grads:
        runs = [split(params, state, g) for params, state in runs]
        runs[1] = split(*runs[1], jax.tree.map(np.asarray, g))  # and a NumPy batch
    assert reads == [1, 1]
    _assert_same_bits(_run(od.simulate(_step(tx)), tx, [g for g in grads for _ in range(2)]), runs[1])


def test_runs_of_two_sizes_keep_their_own_results():
    """Runs of 4 and 8 replicas on one harness, in turn: each gets the results the host keeps
    for its own arguments (shapes with its number of replicas), and lowering the local program
    for shapes alone does not change what a call runs."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=5, nonfinite="ignore")
    split = od.simulate(_step(tx), donate_argnums=(0, 1), split_local_steps=True)
    one = jax.tree.map(lambda x: x[0], (_params(), _grads(4)))
    runs = {n: (od.replicate(one[0], n), od.simulate(tx.init)(od.replicate(one[0], n))) for n in (N, 2 * N)}
    split.lower_local(*jax.eval_shape(lambda: (*runs[N], od.replicate(one[1][0], N))))
    for g in one[1]:
        for n, (params, state) in runs.items():
            runs[n] = split(params, state, od.replicate(g, n))
            assert all(x.shape[0] == n for x in jax.tree.leaves(runs[n]))
    assert split.local_calls == 6
    (pruned,) = [p for (key, _), p in split._pruned.items() if key == LOCAL and p is not None]
    assert len(pruned.donated) + len(pruned.kept) < len(jax.tree.leaves((*runs[N], one[1][0])))


def test_a_kept_result_passed_back_to_be_donated_is_copied():
    """A result that reads no argument (an inner state's scalar reset to a constant) is kept on
    the host, and every state a call returns holds that one array. Where a call passes it back to
    a program that reads and donates it, the program gets a copy: with two runs taking turns on
    one step, no state ever holds a deleted array, and the numbers are those without the split."""

    class Flag(NamedTuple):
        flag: jax.Array

    def update(u, s, p=None):
        return jax.tree.map(lambda g: -0.125 * g * (1 + s.flag), u), Flag(jnp.zeros((), jnp.float32))

    inner = optax.GradientTransformation(lambda p: Flag(jnp.ones((), jnp.float32)), update)
    tx = od.local_sgd(inner, comm=od.AxisComm(REPLICA), period=3, nonfinite="ignore")

    def step(params, state, grads):
        params, state = _step(tx)(params, state, grads)
        return params, state, jnp.sum(grads["b"])

    grads = _grads(9)
    results = []
    for split_local_steps in (False, True):
        split = od.simulate(step, donate_argnums=(0, 1), split_local_steps=split_local_steps)
        runs = [(_params(), od.simulate(tx.init)(_params())) for _ in range(2)]
        for g in grads:
            for r in range(2):
                params, state, metric = split(*runs[r], g)
                runs[r] = (params, state)
                for x in jax.tree.leaves((runs, metric)):
                    assert not x.is_deleted()
        results.append(runs)
    _assert_same_bits(*results)
    assert split.local_calls >= 8 and split.sync_calls >= 4


def test_a_jitted_helper_is_exact_in_both_programs():
    """``optaxdist.apply_updates`` inside the user's own ``jax.jit``: JAX traces it once and
    reuses it in both programs, whichever is traced first; the replicas still hold the same bits
    after each synchronization."""
    tx = od.local_sgd(optax.sgd(0.37), comm=od.AxisComm(REPLICA), period=3, nonfinite="ignore")
    apply = jax.jit(od.apply_updates)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return apply(params, updates, state), state

    grads = [jax.tree.map(lambda g: 1000 * g, g) for g in _grads(6)]
    split = od.simulate(step, split_local_steps=True)
    params, state = _params(), od.simulate(tx.init)(_params())
    split.local_program.lower(params, state, grads[0])  # the local program traced first
    for g in grads:
        params, state = split(params, state, g)
    assert split.local_calls == 3
    assert all(np.array_equal(x[0], x[i]) for x in map(np.asarray, jax.tree.leaves(params)) for i in range(N))


def test_updates_the_harness_cannot_see_run_the_general_program():
    """An update inside another transform's conditional (``optax.MultiSteps``) or one whose counter
    the step does not return: the general program on every call."""
    tx = od.local_sgd(_momentum(), comm=od.AxisComm(REPLICA), period=3)
    accumulated = optax.MultiSteps(tx, every_k_schedule=2)
    split = od.simulate(_step(accumulated), split_local_steps=True)
    expected = _run(od.simulate(_step(accumulated)), accumulated, _grads(12))
    with pytest.warns(UserWarning, match="not one of the step's own arguments and results"):
        _assert_same_bits(expected, _run(split, accumulated, _grads(12)))
    assert split.local_calls == 0

    def forgets_the_state(params, state, grads):
        updates, _ = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    split = od.simulate(forgets_the_state, split_local_steps=True)
    with pytest.warns(UserWarning, match="every call runs the general program"):
        _run(split, tx, _grads(6))
    assert split.local_calls == 0
    with pytest.warns(UserWarning, match="the step runs no periodic transform"):
        od.simulate(_step(_momentum()), split_local_steps=True)(
            _params(), od.simulate(_momentum().init)(_params()), _grads(1)[0]
        )


@pytest.mark.parametrize("where, nonfinite", [("simulate", "ignore"), ("mesh", "ignore"), ("mesh", "skip")])
def test_the_local_program_has_no_collective_and_no_conditional(where, nonfinite):
    """Compiled: no collective, no host callback, and no conditional (the guard selects). Under
    ``simulate`` a collective is a reduction over the stacked replicas: the synchronization's
    average reduces the parameters' floats, the local program reduces none (its counter's
    ``pmax`` reduces an int)."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=5, nonfinite=nonfinite)
    params = _params()
    if where == "simulate":
        split = od.simulate(_step(tx), split_local_steps=True)
        state = od.simulate(tx.init)(params)
    else:
        mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
        split = od.on_mesh(_step(tx), mesh, split_local_steps=True)
        state = od.on_mesh(tx.init, mesh)(params)
    grads = _grads(1)[0]
    compiled = {
        which: program.lower(params, state, grads).compile().as_text()
        for which, program in (("general", split.general_program), ("local", split.local_program))
    }
    conditional, collective = "conditional(", ("all-reduce(", "all-gather(", "collective-permute(")
    assert conditional in compiled["general"]
    assert where == "simulate" or any(c in compiled["general"] for c in collective)
    assert not any(c in compiled["local"] for c in collective)
    averaged = re.compile(r"\bf32\[[\d,]*\](\{[\d,]*\})? reduce\(")
    if where == "simulate":
        assert averaged.search(compiled["general"]) and not averaged.search(compiled["local"])
    assert "custom-call" in compiled["general"] and "custom-call" not in compiled["local"]  # start check
    assert conditional not in compiled["local"]


@pytest.mark.parametrize("where", [pytest.param("simulate", marks=pytest.mark.slow), "mesh"])
def test_a_synchronization_runs_a_program_without_a_conditional(where):
    """A call at a synchronization runs that synchronization's program: the local step and the
    synchronization with no conditional (the guard selects; ``sync_params`` knows the leaves the
    synchronization agreed on), all-reducing on the mesh. It computes the general program's
    numbers (bit for bit here: no product rounds), and every replica holds the same bits."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=3, outer=_outer())
    params = _params()
    if where == "simulate":
        wrap, state = od.simulate, od.simulate(tx.init)(params)
    else:
        mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
        wrap, state = (lambda f, **kw: od.on_mesh(f, mesh, **kw)), od.on_mesh(tx.init, mesh)(params)
    split = wrap(_step(tx), split_local_steps=True)
    grads = _grads(9)
    expected = _run(wrap(_step(tx)), tx, grads, params, state)
    got = _run(split, tx, grads, params, state)
    _assert_same_bits(expected, got)
    assert all((np.asarray(x) == np.asarray(x)[:1]).all() for x in jax.tree.leaves(got[0]))
    # t = 0 the start check (and the anchors), syncs at t = 2, 5, 8
    assert (split.local_calls, split.sync_calls) == (5, 3)
    (program,) = split._syncs.values()
    at_sync = state._replace(step=jnp.full_like(state.step, 2))
    compiled = program.lower(params, at_sync, grads[0]).compile().as_text()
    assert "conditional(" not in compiled
    assert where == "simulate" or "all-reduce(" in compiled


def test_synchronizations_beyond_the_limit_run_the_general_program(monkeypatch):
    """Streaming DiLoCo's fragments sync at different steps, each in a program of its own; past
    ``SYNC_PROGRAMS`` of them a synchronization runs the general program."""
    from optaxdist.parallel import split as split_module

    monkeypatch.setattr(split_module, "SYNC_PROGRAMS", 1)
    build, local_calls, _ = CASES["streaming_diloco"]
    tx = build(od.AxisComm(REPLICA), "ignore")
    grads = _grads(12)
    expected = _run(od.simulate(_step(tx)), tx, grads)
    split = od.simulate(_step(tx), split_local_steps=True)
    _assert_same_bits(expected, _run(split, tx, grads))
    assert len(split._syncs) == 1
    # fragments sync at t = 2, 5, 8, 11 (in turn), each merged a step later (at 3, 6, 9): the
    # first synchronization's program runs at t = 2 and 8
    assert split.local_calls == 12 - 1 - 4 - 3
    assert split.sync_calls == 2


def test_a_schedule_index_out_of_range_runs_the_general_program():
    """A custom schedule that gives an index beyond its synchronizations (the switch clamps it)
    or below 0 gets no program of its own: those calls run the general program."""
    from optaxdist.accounting import Kind
    from optaxdist.transforms.periodic import every_leaf, periodic

    comm = od.AxisComm(REPLICA)
    kind = Kind("all_reduce", "float32", label="mean")

    def mean(x):
        local = comm.pmean(x.local)
        return x._replace(local=local, ledger=x.ledger.record(kind), agreed=every_leaf(local))

    tx = periodic(
        _momentum(),
        comm=comm,
        name="odd",
        schedule=lambda s, num_syncs: jnp.where(s % 3 == 2, 7, jnp.where(s % 3 == 1, -2, 0)),
        syncs=[mean],
        kinds=lambda params, inner_state: {kind: 4},
        check_start=False,
    )
    grads = _grads(9)
    expected = _run(od.simulate(_step(tx)), tx, grads)
    split = od.simulate(_step(tx), split_local_steps=True)
    _assert_same_bits(expected, _run(split, tx, grads))
    assert (split.local_calls, split.sync_calls) == (2, 0)  # t = 3, 6 (t = 0: the first call)


# the mesh by default (its programs run the collectives); simulate, and Heat's quirks, in the full run
@pytest.mark.parametrize(
    "where, quirks",
    [
        pytest.param("simulate", False, marks=pytest.mark.slow),
        ("mesh", False),
        pytest.param("simulate", True, marks=pytest.mark.slow),
    ],
)
def test_daso_runs_a_program_per_kind_of_batch(where, quirks, monkeypatch):
    """DASO's control values (the batch, the cycle, the pending send) are counted on the host
    from batch to batch, and read from the device after an epoch's end, whose cycle the loss
    sets (a plateau here). The epoch's last batch runs the general program; every other batch
    the program of what it does: a local step alone, after a node's gradient average, with a
    send, a merge or a blocking average. They compute the general program's numbers (bit for
    bit here: no product rounds). The local step's program has no conditional and no
    collective, and the others no conditional."""
    from optaxdist.parallel import split as split_module

    nodes, per_node, batches, epochs = 2, 2, 12, 4
    reads = []
    host_counters = split_module._host_counters
    monkeypatch.setattr(split_module, "_host_counters", lambda xs: reads.append(len(xs)) or host_counters(xs))
    if where == "simulate":
        h = od.axis_hierarchy(nodes, per_node)
        wrap = lambda f, **kw: od.simulate(f, axis_name=("node", "local"), shape=(nodes, per_node), **kw)  # noqa: E731
    else:
        h = od.mesh_hierarchy(nodes, per_node, devices=jax.devices()[: nodes * per_node])
        wrap = lambda f, **kw: od.on_mesh(f, h.mesh, **kw)  # noqa: E731
    tx = od.daso(
        _momentum(),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=batches,
        total_epochs=epochs,
        warmup_epochs=1,
        cooldown_epochs=0,
        max_global_skips=8,
        local_skip_factor=4,
        plateau_patience=0,
        heat_quirks=od.HeatQuirks.all() if quirks else None,
    )

    # the mean loss improves in epoch 1, then not in epoch 2: a plateau halves the cycle for epoch 3
    losses = [jnp.full((N,), 2.0 - (t // batches == 1)) for t in range(batches * epochs)]
    grads = _grads(batches * epochs)
    params = _params()
    runs = {}
    for split in (False, True):
        run = wrap(_loss_step(tx), donate_argnums=(0, 1), split_local_steps=split)
        p, state = jax.tree.map(jnp.array, params), wrap(tx.init)(params)
        cycles = []
        for g, loss in zip(grads, losses):
            p, state = run(p, state, g, loss)
            cycles.append(int(np.asarray(state.global_skip).max()))
        runs[split] = (run, p, state, cycles)
    (_, *expected), (split, *got) = runs[False], runs[True]
    _assert_same_bits(expected[:2], got[:2])
    assert len(set(got[2][batches:])) > 2  # the cycle changed: blocking, then two cycles
    # Heat's first cycle, (4, 1, 1), averages the node's gradients before every batch
    assert (split.local_calls == 0) == quirks and len(split._syncs) >= 3
    # the general program: the first call, then each epoch's last batch
    assert split.local_calls + split.sync_calls == batches * epochs - 1 - epochs
    assert reads == [8] * epochs  # the control, in one read: at the second call, after each epoch's end
    compiled = split.local_program.lower(params, state, grads[0], losses[0]).compile().as_text()
    assert "conditional(" not in compiled and "all-reduce(" not in compiled
    # nor has any batch's program: the broadcast within the node takes its root (state) traced
    for program in split._syncs.values():
        assert "conditional(" not in program.lower(params, state, grads[0], losses[0]).compile().as_text()


def test_daso_sends_bfloat16_parameters_as_the_general_program_rounds_them():
    """bfloat16 parameters summed over the nodes in float32: a program of one branch sends the
    parameters after the local step rounded to bfloat16, as the general program's conditionals
    leave them (XLA:CPU may otherwise keep them in float32: excess precision)."""
    h = od.axis_hierarchy(2, 2)
    tx = od.daso(
        _momentum(),
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=12,
        total_epochs=3,
        downcast="float32",
        warmup_epochs=1,
        cooldown_epochs=1,
    )

    wrap = lambda f, **kw: od.simulate(f, axis_name=("node", "local"), shape=(2, 2), **kw)  # noqa: E731
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), _params())
    grads = [jax.tree.map(lambda g: g.astype(jnp.bfloat16), g) for g in _grads(3)]
    runs = []
    for split in (False, True):
        run, p, state = wrap(_loss_step(tx), split_local_steps=split), params, wrap(tx.init)(params)
        for g in grads:  # the start, then two blocking averages of the warm-up
            p, state = run(p, state, g, jnp.ones(N))
        runs.append((p, state))
    _assert_same_bits(*runs)
    assert run.sync_calls == 2


def test_kept_results_are_placed_like_the_arguments():
    """On another device than the default one, committed: the results the host keeps are
    committed there too, as the whole program's are, so no call meets an argument placed
    otherwise and the general program compiles once (DASO ends an epoch in it every 4 calls)."""
    device = jax.devices()[1]
    tx, wrap = _small_daso()
    split = wrap(_loss_step(tx), donate_argnums=(0, 1), split_local_steps=True)
    grads, loss = jax.device_put(_grads(12), device), jax.device_put(jnp.ones(N), device)
    runs = []
    for run in (wrap(_loss_step(tx)), split):
        params = jax.device_put(_params(), device)
        state = jax.device_put(wrap(tx.init)(params), device)
        for g in grads:
            params, state = run(params, state, g, loss)
        runs.append((params, state))
    assert split.sync_calls > 0 and any(p.constant for p in split._pruned.values() if p is not None)
    assert all(x.committed and x.devices() == {device} for x in jax.tree.leaves(runs[1]))
    assert split.general_program._cache_size() == 1
    _assert_same_bits(*runs)


def test_a_result_computed_by_a_collective_is_not_kept_on_the_host():
    """A step that also returns a collective of a constant (a replica count as a metric) reads
    no argument for it, but on a mesh it communicates: the program computes it on every call
    rather than a program of its own, run outside the harness's."""
    tx = od.local_sgd(_momentum(), comm=od.AxisComm(REPLICA), period=5, nonfinite="ignore")

    def step(params, state, grads):
        return (*_step(tx)(params, state, grads), od.AxisComm(REPLICA).psum(jnp.float32(1.0)))

    mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
    split = od.on_mesh(step, mesh, donate_argnums=(0, 1), split_local_steps=True)
    params, state = _params(), od.on_mesh(tx.init, mesh)(_params())
    for g in _grads(4):
        params, state, replicas = split(params, state, g)
        np.testing.assert_array_equal(replicas, np.full(N, N, np.float32))
    (pruned,) = [p for (key, _), p in split._pruned.items() if key == LOCAL and p is not None]
    assert split.local_calls == 3 and not pruned.constant


@pytest.mark.parametrize("where", ["simulate", "mesh"])
def test_the_local_program_takes_and_returns_only_what_it_changes(where):
    """Between synchronizations DiLoCo's anchors, its outer momentum and the ledger come back as
    the very arrays the call got: the local program neither takes, donates nor returns them. It
    donates the parameters and the inner state. Its results that are the same on every call (the
    exact-sync flags, "no sync") come back as the arrays a program of their own computed once (a
    synchronization's program does not take them): the whole local program is never compiled.
    Every number is the general program's."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=5, outer=_outer(), nonfinite="ignore")
    if where == "simulate":
        wrap, init = od.simulate, od.simulate(tx.init)
    else:
        mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
        wrap, init = (lambda f, **kw: od.on_mesh(f, mesh, **kw)), od.on_mesh(tx.init, mesh)
    split = wrap(_step(tx), donate_argnums=(0, 1), split_local_steps=True)
    grads = _grads(12)
    params, state = _params(), init(_params())
    expected = _run(wrap(_step(tx)), tx, grads, params, state)
    passed_through, held = [], None
    for t, g in enumerate(grads):
        kept = jax.tree.leaves((state.sync_state, state.ledger))
        donated = jax.tree.leaves((params, state.inner_state))
        before = split.local_calls
        params, state = split(params, state, g)
        if split.local_calls == before:
            continue
        after = jax.tree.leaves((state.sync_state, state.ledger))
        constant = jax.tree.leaves((state.last_sync, state.agreed.fresh))
        if all(a is b for a, b in zip(after, kept)):
            assert not any(a.is_deleted() for a in after) and all(x.is_deleted() for x in donated)
            assert held is None or all(a is b for a, b in zip(constant, held))
            passed_through.append(t)
        held = constant
    # syncs at t = 4, 9 (the start check's call is t = 0): each synchronization's program takes
    # what it reads, not the flags the local program keeps
    assert split.local_calls == 12 - 1 - 2
    assert passed_through == [1, 2, 3, 5, 6, 7, 8, 10, 11]
    assert split.local_program._cache_size() == 0
    # the kept results are placed as the whole program places its results
    assert [x.sharding for x in jax.tree.leaves(state)] == [x.sharding for x in jax.tree.leaves(expected[1])]
    # it takes the parameters, the inner state, the counter and the gradients, not the anchors:
    # sync_params has nothing to set on a local step
    (pruned,) = [p for (key, _), p in split._pruned.items() if key == LOCAL and p is not None]
    reads = jax.tree.leaves((params, state.inner_state, state.step, grads[0]))
    assert len(pruned.donated) + len(pruned.kept) == len(reads)
    args = (params, state, grads[0])
    lowered, whole = split.lower_local(*args), split.local_program.lower(*args)
    assert len(jax.tree.leaves(lowered.args_info)) == len(reads) < len(jax.tree.leaves(whole.args_info))
    _assert_same_bits(expected, (params, state))


def test_no_result_shares_a_buffer_the_caller_still_holds():
    """Only a donated argument comes back as it came, and in one result only. A step that also
    returns what it does not change (DiLoCo's anchors for a log, next to the state) or keeps its
    last gradients in its state gets new buffers for them, as without the option, so no later
    call deletes an array the caller still holds; the same array at a donated position and
    another one is JAX's error, as without the option."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=4)

    def step(params, carry, grads):
        state, previous = carry
        g = jax.tree.map(lambda a, b: 0.5 * (a + b), grads, previous)
        updates, state = tx.update(g, state, params)
        logged = {"anchors": state.sync_state.anchors[0]}
        return od.apply_updates(params, updates, state), (state, grads), logged

    split = od.simulate(step, donate_argnums=(0, 1), split_local_steps=True)
    grads, logs = _grads(8), []
    params = _params()
    carry = (od.simulate(tx.init)(params), jax.tree.map(jnp.zeros_like, grads[0]))
    for g in grads:
        params, carry, logged = split(params, carry, g)
        logs.append(logged)
    assert split.local_calls == 8 - 1 - 2
    assert not any(x.is_deleted() for x in jax.tree.leaves((logs, grads)))

    def keeps(params, state, grads, best):  # ``best``: for a roll-back, not read
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state, best

    for run in (
        od.simulate(keeps, donate_argnums=(0, 1)),
        od.simulate(keeps, donate_argnums=(0, 1), split_local_steps=True),
    ):
        params = _params()
        state, best = od.simulate(tx.init)(params), jax.tree.map(jnp.copy, params)
        for g in grads[:2]:
            params, state, best = run(params, state, g, best)
        with pytest.raises(Exception, match="donated"):
            run(best, state, grads[2], best)  # roll back


def test_a_model_split_argument_gets_the_whole_local_program():
    """Arguments split over a mesh axis beyond the replicas' (a model axis): the harness places
    results like arguments, so the local program takes and returns every leaf, even donated (a
    pruned program would hand the anchors back as they came)."""
    tx = od.diloco(_momentum(), comm=od.AxisComm(REPLICA), period=5, nonfinite="ignore")
    auto = (jax.sharding.AxisType.Auto,) * 2  # the model axis left to the compiler
    mesh = jax.make_mesh((N, 2), (REPLICA, "model"), devices=jax.devices()[: 2 * N], axis_types=auto)
    split = od.on_mesh(_step(tx), mesh, axis_name=REPLICA, donate_argnums=(0, 1), split_local_steps=True)
    place = {"w": P(REPLICA, None, "model"), "b": P(REPLICA, "model")}
    params = {k: jax.device_put(v, NamedSharding(mesh, place[k])) for k, v in _params().items()}
    state = od.on_mesh(tx.init, mesh, axis_name=REPLICA)(params)
    expected = _run(od.on_mesh(_step(tx), mesh, axis_name=REPLICA), tx, _grads(4), params, state)
    for g in _grads(4):
        anchors = jax.tree.leaves(state.sync_state.anchors)
        params, state = split(params, state, g)
    assert split.local_calls == 3
    assert not any(a is b for a, b in zip(jax.tree.leaves(state.sync_state.anchors), anchors))
    for leaf in (params["w"], state.sync_state.anchors[0]["w"]):
        assert leaf.sharding.spec == place["w"]
    _assert_same_bits(expected, (params, state))


def test_fma_in_the_local_program_is_the_only_difference():
    """With a learning rate whose products round, the local program's ``params + lr · m`` may be
    one fused multiply-add: the runs agree to a rounding per step, and after a synchronization
    every replica holds the same bits."""
    tx = od.local_sgd(optax.sgd(0.1, momentum=0.9), comm=od.AxisComm(REPLICA), period=7, nonfinite="ignore")
    grads = _grads(35)  # the last update synchronizes
    expected, _ = _run(od.simulate(_step(tx)), tx, grads)
    got, _ = _run(od.simulate(_step(tx), split_local_steps=True), tx, grads)
    for x, y in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-5, atol=1e-6)
        assert (np.asarray(y) == np.asarray(y)[:1]).all()


def test_bad_settings():
    with pytest.raises(ValueError, match="split_local_steps='yes' must be a bool"):
        od.simulate(lambda x: x, split_local_steps="yes")
    with pytest.raises(ValueError, match="split_local_steps=True needs jit=True"):
        od.simulate(lambda x: x, jit=False, split_local_steps=True)
    mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
    with pytest.raises(ValueError, match="split_local_steps=1 must be a bool"):
        od.on_mesh(lambda x: x, mesh, split_local_steps=1)


def test_the_configuration_check_still_reads_the_users_step():
    """On several processes each program's first call compares the configuration, including the
    optax transformations the user's step refers to (not the harness's recording wrapper)."""
    from optaxdist.agreement import describe_step

    tx = CASES["local_sgd"][0](od.AxisComm(REPLICA), "skip")
    mesh = jax.make_mesh((N,), (REPLICA,), devices=jax.devices()[:N])
    train_step = _step(tx)
    split = od.on_mesh(train_step, mesh, split_local_steps=True)
    params = _params()
    state = od.on_mesh(tx.init, mesh)(params)
    for program in (split.general_program, split.local_program):
        described = describe_step(program._traced, params, state, _grads(1)[0], user_step=program._step)
        assert "tx" in described["optimizers the step refers to"]


def test_a_new_run_on_the_same_step_is_checked_at_its_first_update():
    """The start check's step (counter 0) runs the general program, also when the harness has
    already seen the step: replicas that differ are refused."""
    tx = CASES["local_sgd"][0](od.AxisComm(REPLICA), "skip")
    split = od.simulate(_step(tx), split_local_steps=True)
    _run(split, tx, _grads(10))
    offsets = lambda p: jnp.arange(N, dtype=p.dtype).reshape((N,) + (1,) * (p.ndim - 1))  # noqa: E731
    differ = jax.tree.map(lambda p: p + offsets(p), _params())
    with pytest.raises(Exception, match="replicas do not start from identical parameters"):
        _run(split, tx, _grads(1), params=differ, state=od.simulate(tx.init)(differ))


def test_several_periodic_transforms_in_one_step():
    """Each update's own schedule: the local program runs only when neither synchronizes."""
    comm = od.AxisComm(REPLICA)
    tx = optax.multi_transform(
        {
            "w": od.local_sgd(_momentum(), comm=comm, period=3),  # syncs at t = 2, 5, 8, 11, 14
            "b": od.local_sgd(_momentum(), comm=comm, period=5),  # syncs at t = 4, 9, 14
        },
        {"w": "w", "b": "b"},
    )
    grads = _grads(16)
    expected = _run(od.simulate(_step(tx)), tx, grads)
    split = od.simulate(_step(tx), split_local_steps=True)
    _assert_same_bits(expected, _run(split, tx, grads))
    assert split.local_calls == 16 - 1 - 5 - 2  # not 0 (start check), nor a sync of either


@pytest.mark.parametrize("start", [4090, np.iinfo(np.int32).max - 3])
def test_counters_beyond_a_table_and_at_saturation(start, monkeypatch):
    """Schedules evaluated in tables of 4 counter values (refilled as the counters move on, and
    cleared past 8), and counters that saturate at the int32 maximum: the same numbers as the
    general program."""
    from optaxdist.parallel import split as split_module

    monkeypatch.setattr(split_module, "TABLE_SIZE", 4)
    monkeypatch.setattr(split_module, "TABLE_LIMIT", 8)
    tx = CASES["local_sgd"][0](od.AxisComm(REPLICA), "skip")
    params = _params()
    state = od.simulate(tx.init)(params)
    state = state._replace(step=jnp.full_like(state.step, start))
    grads = _grads(12)
    expected = _run(od.simulate(_step(tx)), tx, grads, params, state)
    split = od.simulate(_step(tx), split_local_steps=True)
    _assert_same_bits(expected, _run(split, tx, grads, params, state))
    assert split.local_calls > 6
    ((table,),) = (entry.plan.tables for entry in split._entries.values())
    if start == 4090:  # 12 steps from 4090: the table was cleared past 8, the last refill kept
        assert sorted(table) == [(4099,), (4100,), (4101,), (4102,)]
    else:  # saturated: the maximum steps to itself
        assert max(table) == (np.iinfo(np.int32).max,) and len(table) < 8


@pytest.mark.slow  # two signatures in the default run: test_runs_of_two_sizes_keep_their_own_results
def test_a_schedule_chosen_from_the_shapes_is_traced_again():
    """Two argument signatures of the same structure get their own traces, and their own
    schedules (here the step picks its transform from the parameters' shape)."""
    comm = od.AxisComm(REPLICA)
    every_3, every_5 = (od.local_sgd(_momentum(), comm=comm, period=p, check_start=False) for p in (3, 5))

    def step(params, state, grads):
        tx = every_3 if params.shape[-1] == 3 else every_5
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state

    def run(harness, shape):
        params = od.replicate(jnp.ones(shape), N)
        state = od.simulate(every_5.init)(params)
        keys = jax.random.split(jax.random.key(2), 7)
        for k in keys:
            params, state = harness(params, state, random_normal(k, params.shape))
        return params, state

    split, general = od.simulate(step, split_local_steps=True), od.simulate(step)
    for shape in [(4, 3), (3, 4), (4, 3)]:  # the last one runs an executable compiled before
        _assert_same_bits(run(general, shape), run(split, shape))


@pytest.mark.slow  # the same cause as Flax NNX's, tested below
def test_a_step_that_updates_its_arguments_in_place():
    """A step that writes the new state into its argument (a dict here; Flax NNX's ``merge`` and
    ``Optimizer.update`` do the same with their Variables) still runs the local program."""
    tx = CASES["diloco"][0](od.AxisComm(REPLICA), "skip")

    def step(carry, grads):
        updates, carry["state"] = tx.update(grads, carry["state"], carry["params"])
        carry["params"] = od.apply_updates(carry["params"], updates, carry["state"])
        return carry

    def run(harness):
        carry = {"params": _params(), "state": od.simulate(tx.init)(_params())}
        for g in _grads():
            carry = harness(carry, g)
        return carry

    split = od.simulate(step, split_local_steps=True)
    _assert_same_bits(run(od.simulate(step)), run(split))
    assert split.local_calls == CASES["diloco"][1]


def test_flax_nnx_runs_the_local_program():
    from flax import nnx

    comm = od.AxisComm(REPLICA)

    def make():
        model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, od.local_sgd(_momentum(), comm=comm, period=5), wrt=nnx.Param)
        return od.nnx_replicate((model, optimizer), N)

    def train(objects, x):
        model, optimizer = objects
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    x = random_normal(jax.random.key(3), (N, 4, 3))
    results = []
    for split in (False, True):
        graphdef, state = make()
        step = od.simulate(od.nnx_step(graphdef, train), donate_argnums=(0,), split_local_steps=split)
        for _ in range(12):
            state, loss = step(state, x)
        results.append((state, loss))
    _assert_same_bits(*results)
    assert step.local_calls == 12 - 1 - 2  # not t = 0 (start check), nor the syncs at 4, 9


def test_a_general_call_leaves_the_kept_results_of_other_states_alone():
    """The results the host keeps (DASO's constant flags) are the same arrays in every state a
    call returned. Two runs taking turns: a call that runs the general program and donates (an
    epoch's end) consumes copies of them, never the arrays the other run's state holds."""
    tx, wrap = _small_daso()
    split = wrap(_loss_step(tx), donate_argnums=(0, 1), split_local_steps=True)
    loss = jnp.ones(N)
    runs = [(params, wrap(tx.init)(params)) for params in (_params(), _params())]
    shared = False
    for g in _grads(12):
        for turn in (0, 1):
            runs[turn] = split(*runs[turn], g, loss)
            other = jax.tree.leaves(runs[1 - turn])
            assert not any(x.is_deleted() for x in other)
            shared |= any(id(x) in split._kept for x in other)
    assert shared and split.sync_calls > 0
