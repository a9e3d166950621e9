"""Local SGD, post-local SGD, hierarchical averaging, DiLoCo and SlowMo."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.bench.data import random_normal
from tests.problems import init_params, np_grad, replica_data
from tests.test_allreduce import LR, run_trajectory

STEPS = 12
START_CHECK_BYTES = 4 * 2 + 4  # one uint32 fingerprint per leaf (w, b) and a 4-byte vote


def sync_stats(state):
    """Ledger totals without the one-time start check (tested in test_check_start)."""
    stats = dict(od.comm_stats(state).by_kind)
    start = stats.pop("broadcast[start check]", None)
    assert start in (None, od.KindTotals(1, START_CHECK_BYTES)), start
    return stats


def close(a, b, atol=1e-5):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], atol=atol, rtol=0)


# the mean at every step of matches_numpy_and_bytes: on the mesh and under mpirun in the full run
@pytest.mark.sample()
def test_period_one_equals_synchronous_sgd(harness):
    a, _ = run_trajectory(harness, lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=1))
    b, _ = run_trajectory(harness, lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(LR)))
    close(a, b, atol=1e-6)


def np_local_sgd(n, period, steps=STEPS, lr=LR):
    params = [{k: v.astype(np.float64) for k, v in init_params().items()} for _ in range(n)]
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        for i in range(n):
            g = np_grad(params[i], xs[t, i], ys[t, i])
            params[i] = {k: params[i][k] - lr * g[k] for k in g}
        if (t + 1) % period == 0:
            mean = {k: sum(p[k] for p in params) / n for k in params[0]}
            params = [dict(mean) for _ in range(n)]
    return {k: np.stack([p[k] for p in params]) for k in params[0]}


def test_local_sgd_matches_numpy_and_bytes(harness):
    period = 4
    params, state = run_trajectory(
        harness, lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=period), steps=STEPS
    )
    close(params, np_local_sgd(harness.n, period))
    p_bytes = sum(v.nbytes for v in init_params().values())
    assert sync_stats(state) == {
        "param_average[float32]": od.KindTotals(STEPS // period, STEPS // period * p_bytes)
    }


def test_post_local_warmup_is_synchronous_then_local(harness):
    warm, period = 5, 3
    params, state = run_trajectory(
        harness,
        lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=period, warmup_steps=warm),
        steps=warm,
    )
    ref, _ = run_trajectory(harness, lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(LR)), steps=warm)
    close(params, ref, atol=1e-6)
    od.assert_replicas_identical(params)
    params, state = run_trajectory(
        harness,
        lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=period, warmup_steps=warm),
        steps=warm + 2 * period,
    )
    stats = sync_stats(state)
    assert stats["all_reduce[float32]"].collectives == warm
    assert stats["param_average[float32]"].collectives == 2


def test_inner_state_averaging(harness):
    n = harness.n
    tx_factory = lambda c: od.local_sgd(
        optax.sgd(LR, momentum=0.9), comm=c, period=2, average_inner_state=True
    )
    _, state = run_trajectory(harness, tx_factory, steps=4)
    momentum = [x for x in jax.tree.leaves(state.inner_state) if x.dtype == np.float32]
    for m in momentum:
        np.testing.assert_allclose(m, np.broadcast_to(m.mean(0), m.shape), atol=1e-6)
    if n > 1:
        _, state = run_trajectory(
            harness, lambda c: od.local_sgd(optax.sgd(LR, momentum=0.9), comm=c, period=2), steps=4
        )
        momentum = [x for x in jax.tree.leaves(state.inner_state) if x.dtype == np.float32]
        assert any(not np.allclose(m, m.mean(0)) for m in momentum)


def test_sync_model_state_only_on_sync_steps(harness):
    comm, n = harness.comm, harness.n
    tx = od.local_sgd(optax.sgd(LR), comm=comm, period=2)
    stats0 = np.arange(n, dtype=np.float32)[:, None] * np.ones((n, 3), np.float32)

    def two_steps(p, bn):
        s = tx.init(p)
        _, s = tx.update(p, s, p)
        bn1 = od.sync_model_state(bn, s, comm=comm)
        _, s = tx.update(p, s, p)
        bn2 = od.sync_model_state({"mean": bn1, "count": jnp.int32(7)}, s, comm=comm)
        return bn1, bn2

    bn1, bn2 = harness.run(two_steps, np.zeros((n, 2), np.float32), stats0)
    np.testing.assert_array_equal(bn1, stats0)  # step 1: no sync
    np.testing.assert_allclose(bn2["mean"], np.broadcast_to(stats0.mean(0), stats0.shape))
    assert (bn2["count"] == 7).all()


def test_hierarchical_levels():
    nodes, local = 2, 4
    h = od.axis_hierarchy(nodes, local)
    tx = od.local_sgd(
        optax.sgd(1.0), comm=h.world, period=4, local_comm=h.local, local_period=2, check_start=False
    )  # replicas start apart on purpose
    x = np.arange(nodes * local, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)

    def run(p):
        s, bn = tx.init(p), p  # bn: model state (BatchNorm statistics), here the starting values
        out = []
        for _ in range(4):
            u, s = tx.update(jnp.zeros_like(p), s, p)
            p = optax.apply_updates(p, u)
            out.append((p, s.last_sync, od.sync_model_state(bn, s, comm=h.world, local_comm=h.local)))
        return out, s

    sim = od.simulate(run, axis_name=("node", "local"), shape=(nodes, local))(x)
    mh = od.mesh_hierarchy(nodes, local)
    mesh = od.on_mesh(run, mh.mesh)(x)
    for out, state in (sim, mesh):
        levels = [int(lv[0]) for _, lv, _ in out]
        assert levels == [0, 1, 0, 2]
        node_mean = np.repeat(x.reshape(nodes, local, 2).mean(1), local, axis=0)
        np.testing.assert_allclose(out[1][0], node_mean)
        np.testing.assert_allclose(out[3][0], np.broadcast_to(x.mean(0), x.shape))
        # the model state follows the same levels: unchanged, node mean, unchanged, global mean
        for (_, _, bn), want in zip(out, [x, node_mean, x, np.broadcast_to(x.mean(0), x.shape)]):
            np.testing.assert_allclose(bn, want)
        stats = sync_stats(state)
        assert stats["local:param_average[float32]"].collectives == 1
        assert stats["param_average[float32]"].collectives == 1


def test_sync_model_state_needs_the_node_comm_of_a_two_level_local_sgd():
    h = od.axis_hierarchy(2, 2)
    tx = od.local_sgd(optax.sgd(1.0), comm=h.world, period=4, local_comm=h.local, local_period=2)

    def step(p):
        _, s = tx.update(p, tx.init(p), p)
        return od.sync_model_state(p, s, comm=h.world)

    with pytest.raises(ValueError, match="pass the same local_comm to sync_model_state"):
        od.simulate(step, axis_name=("node", "local"), shape=(2, 2))(np.zeros((4, 2), np.float32))


# test_partial's test_diloco_warmup_equals_local_sgd_warmup makes the same comparison, with a warm-up
@pytest.mark.slow
def test_diloco_with_sgd_one_equals_local_sgd(harness):
    a, _ = run_trajectory(
        harness, lambda c: od.diloco(optax.sgd(LR), optax.sgd(1.0), comm=c, period=3), steps=STEPS
    )
    b, _ = run_trajectory(harness, lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=3), steps=STEPS)
    close(a, b, atol=1e-6)


# a special case of test_slowmo_matches_fairscale_formula: on the mesh and under mpirun in the full run
@pytest.mark.sample()
def test_slowmo_without_momentum_equals_local_sgd(harness):
    a, _ = run_trajectory(
        harness,
        lambda c: od.slowmo(optax.sgd(LR), comm=c, period=3, learning_rate=LR, momentum=0.0),
        steps=STEPS,
    )
    b, _ = run_trajectory(harness, lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=3), steps=STEPS)
    close(a, b, atol=1e-6)


def np_slowmo(n, tau, beta, alpha, lr_fn, steps=STEPS, after_first=False):
    """fairscale's formula, transcribed."""
    params = [{k: v.astype(np.float64) for k, v in init_params().items()} for _ in range(n)]
    x0 = {k: v.copy() for k, v in params[0].items()}
    u = {k: np.zeros_like(v) for k, v in x0.items()}
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        for i in range(n):
            g = np_grad(params[i], xs[t, i], ys[t, i])
            params[i] = {k: params[i][k] - lr_fn(t) * g[k] for k in g}
        if after_first and t == 0:
            x0 = {k: sum(p[k] for p in params) / n for k in x0}
        if (t + 1) % tau == 0:
            mean = {k: sum(p[k] for p in params) / n for k in x0}
            u = {k: beta * u[k] + (x0[k] - mean[k]) / lr_fn(t) for k in x0}
            x0 = {k: x0[k] - alpha * lr_fn(t) * u[k] for k in x0}
            params = [dict(x0) for _ in range(n)]
    return {k: np.stack([p[k] for p in params]) for k in params[0]}


@pytest.mark.sample("False", harnesses=("mpi",))  # under mpirun one layout each (below: True)
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_slowmo_matches_fairscale_formula(harness, memory_efficient):
    n = harness.n
    sched = optax.exponential_decay(LR, transition_steps=4, decay_rate=0.5)
    kw = dict(num_shards=n) if memory_efficient else {}
    params, state = run_trajectory(
        harness,
        lambda c: od.slowmo(
            optax.sgd(sched),
            comm=c,
            period=3,
            learning_rate=sched,
            momentum=0.5,
            slow_lr=0.8,
            **kw,
        ),
        steps=STEPS,
    )
    want = np_slowmo(n, 3, 0.5, 0.8, lambda t: LR * 0.5 ** (t / 4))
    close(params, want)
    p_elems = sum(v.size for v in init_params().values())
    stats = sync_stats(state)
    syncs = STEPS // 3
    if memory_efficient:
        block = -(-p_elems // n)
        assert stats == {
            "reduce_scatter[float32]": od.KindTotals(syncs, syncs * block * n * 4),
            "all_gather[float32]": od.KindTotals(syncs, syncs * block * 4),
        }
    else:
        assert stats == {"all_reduce[float32]": od.KindTotals(syncs, syncs * p_elems * 4)}


@pytest.mark.sample("True", harnesses=("mpi",))
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_slowmo_anchor_after_first_step(harness, memory_efficient):
    n = harness.n
    kw = dict(num_shards=n) if memory_efficient else {}
    params, _ = run_trajectory(
        harness,
        lambda c: od.slowmo(
            optax.sgd(LR),
            comm=c,
            period=3,
            learning_rate=LR,
            momentum=0.5,
            anchor_after_first_step=True,
            **kw,
        ),
        steps=6,
    )
    # x0 = the replicas' mean after step 0: the first slow step covers 2 local steps
    close(params, np_slowmo(n, 3, 0.5, 1.0, lambda t: LR, steps=6, after_first=True))
    assert not np.allclose(params["w"], np_slowmo(n, 3, 0.5, 1.0, lambda t: LR, steps=6)["w"])


def test_diloco_defaults_and_compressed_pseudo_gradients(harness):
    n = harness.n
    period = 4
    params, state = run_trajectory(
        harness,
        lambda c: od.diloco(
            optax.sgd(LR),
            comm=c,
            period=period,
            reducer=od.compressed_allreduce(od.compress.top_k(fraction=0.5), comm=c),
        ),
        steps=2 * period,
    )
    # params + (x0 − params) is x0 up to an ulp: the anchor in the state is the exact copy
    np.testing.assert_allclose(params["w"], np.broadcast_to(params["w"][0], params["w"].shape), atol=1e-6)
    od.assert_replicas_identical(state.sync_state.anchors)
    assert np.isfinite(params["w"]).all()
    stats = sync_stats(state)
    w, b = init_params()["w"].size, init_params()["b"].size
    k = w // 2 + b // 2
    assert stats == {"all_gather[top_k]": od.KindTotals(2, 2 * k * 8)}
    assert jax.tree.leaves(state.sync_state.reducer_states[0].error)  # per-replica residuals kept
    del n


def poisoned_runs(harness, tx, poisons, steps):
    """``steps`` steps of ``tx`` on the least-squares problem from the start, once per array of
    ``poisons`` (``poison[i, t]`` multiplies replica ``i``'s gradient at step ``t``), the runs one
    after the other in one program. Returns each run's final params and state."""
    from tests.test_loss_scale import scan_steps

    xs, ys = replica_data(harness.n, steps)
    params0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), harness.n)
    run = lambda p, x, y, bad: jax.lax.map(lambda b: scan_steps(tx, p, x, y, b)[:2], bad)
    xs, ys, bad = np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1), np.stack(poisons, axis=1)
    p, s = harness.run(run, params0, xs, ys, bad)
    return [jax.tree.map(lambda x, i=i: x[:, i], (p, s)) for i in range(len(poisons))]


def finite_tree(tree) -> bool:
    return all(np.isfinite(x).all() for x in jax.tree.leaves(tree) if np.issubdtype(x.dtype, np.inexact))


# Every transform's guard is the periodic engine's; the default run keeps one of each kind of
# synchronization (a mean, a mean of the inner state too, a sharded outer step, fragments,
# push-sum gossip) on vmap and local SGD's on the mesh and under mpirun, the full run all of them.
GUARDED = {
    "local_sgd": lambda c, n: od.local_sgd(optax.sgd(LR), comm=c, period=4),
    "local_sgd_inner_avg": lambda c, n: od.local_sgd(
        optax.sgd(LR), comm=c, period=4, average_inner_state=True
    ),
    "diloco": lambda c, n: od.diloco(optax.sgd(LR), comm=c, period=4),
    "diloco_sharded": lambda c, n: od.diloco(optax.sgd(LR), comm=c, period=4, num_shards=n),
    "slowmo": lambda c, n: od.slowmo(optax.sgd(LR), comm=c, period=4, learning_rate=LR),
    "partial_average": lambda c, n: od.partial_average(optax.sgd(LR), comm=c),
    "streaming_diloco": lambda c, n: od.streaming_diloco(optax.sgd(LR), comm=c, period=4, num_fragments=2),
    "dpsgd": lambda c, n: od.decentralized_sgd(optax.sgd(LR), comm=c, topology=od.topology.ring(n)),
    "sgp": lambda c, n: od.sgp(optax.sgd(LR), comm=c, topology=od.topology.exponential(n)),
}


@pytest.mark.sample("local_sgd")
@pytest.mark.sample(
    "local_sgd", "local_sgd_inner_avg", "diloco_sharded", "streaming_diloco", "sgp", harnesses=("vmap",)
)
@pytest.mark.parametrize("name", list(GUARDED))
def test_nonfinite_gradient_skips_only_that_local_step(harness, name):
    """A NaN/Inf gradient on one replica skips that replica's local step and nothing else: the
    result equals the run where that gradient was zero (plain SGD), on every replica."""
    n, steps = harness.n, 10
    poison = np.ones((n, steps), np.float32)
    poison[n - 1, 1], poison[0, 5] = np.nan, np.inf
    zeroed = np.where(np.isfinite(poison), poison, 0.0).astype(np.float32)
    (p, s), (ref, _) = poisoned_runs(harness, GUARDED[name](harness.comm, n), [poison, zeroed], steps)
    assert finite_tree(p) and finite_tree(s)
    close(p, ref, atol=1e-6)


def test_bad_arguments():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="period="):
        od.local_sgd(optax.sgd(0.1), comm=comm, period=0)
    with pytest.raises(ValueError, match="warmup_steps="):
        od.local_sgd(optax.sgd(0.1), comm=comm, period=2, warmup_steps=-1)
    with pytest.raises(ValueError, match="local_period="):
        od.local_sgd(optax.sgd(0.1), comm=comm, period=6, local_comm=comm, local_period=4)
    with pytest.raises(ValueError, match="both local_comm"):
        od.local_sgd(optax.sgd(0.1), comm=comm, period=6, local_period=2)
    with pytest.raises(ValueError, match="period="):
        od.diloco(optax.sgd(0.1), comm=comm, period=0)
    for flag in ("no", 0, None):  # "no" is truthy: the check would silently stay on
        with pytest.raises(ValueError, match=f"check_start={flag!r} must be a bool"):
            od.diloco(optax.sgd(0.1), comm=comm, period=2, check_start=flag)
    for momentum in (-1.0, 1.0):
        with pytest.raises(ValueError, match=r"momentum=.* must be in \[0, 1\)"):
            od.slowmo(optax.sgd(0.1), comm=comm, period=4, learning_rate=0.1, momentum=momentum)
    for lr in (0.0, -0.1):
        with pytest.raises(ValueError, match="learning_rate=.* must be > 0"):
            od.slowmo(optax.sgd(0.1), comm=comm, period=4, learning_rate=lr)
    with pytest.raises(ValueError, match=r"every leaf must be floating point, got int32 at \['step'\]"):
        od.diloco(optax.sgd(0.1), comm=comm, period=2).init(
            {"w": jnp.ones(2), "step": jnp.zeros((), jnp.int32)}
        )
    with pytest.raises(ValueError, match="can't be combined"):
        od.outer_sync(
            optax.sgd(0.1), optax.sgd(1.0), comm=comm, period=2, num_shards=2, reducer=od.allreduce(comm=comm)
        )


# the start check is the engine's, one for every transform: on the mesh and under mpirun local SGD's
# by default
CHECKED_START = {
    "local_sgd": lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=2),
    "diloco": lambda c: od.diloco(optax.sgd(LR), comm=c, period=2),
    "partial_average": lambda c: od.partial_average(optax.sgd(LR), comm=c),
    "streaming_diloco": lambda c: od.streaming_diloco(optax.sgd(LR), comm=c, period=2, num_fragments=2),
}


@pytest.mark.sample("local_sgd")
@pytest.mark.parametrize("name", list(CHECKED_START))
def test_check_start(harness, name):
    n = harness.n
    tx = CHECKED_START[name](harness.comm)
    p = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)

    def two_steps(q):
        s = tx.init(q)
        u, s = tx.update(q, s, q)
        u, s = tx.update(q, s, optax.apply_updates(q, u))
        return s

    state = harness.run(two_steps, p)
    assert od.comm_stats(state).by_kind["broadcast[start check]"] == od.KindTotals(1, START_CHECK_BYTES)
    if n > 1:
        different = jax.tree.map(lambda x: x.at[n - 1].add(1.0), p)
        with pytest.raises(Exception, match="do not start from identical parameters"):
            harness.run(two_steps, different)


def test_check_start_with_a_batched_step_counter():
    """State built by jax.vmap(tx.init) carries a batched counter: under vmap both branches of the
    step-0 check run on every step; it must still only look at step 0."""
    comm = od.AxisComm("replica")
    tx = od.local_sgd(optax.sgd(LR), comm=comm, period=3)
    n = 4
    p = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)
    state = jax.vmap(tx.init)(p)
    xs, ys = replica_data(n, 5)

    def step(q, s, x, y):
        u, s = tx.update(jax.grad(lambda r: jnp.sum((x @ r["w"] + r["b"] - y) ** 2))(q), s, q)
        return optax.apply_updates(q, u), s

    run = od.simulate(step)
    for t in range(5):  # replicas differ between syncs: the check must not fire
        p, state = run(p, state, xs[t], ys[t])
    jax.block_until_ready(p)
    assert od.comm_stats(state).by_kind["broadcast[start check]"].collectives == 1


def test_fingerprint_sees_any_single_change():
    from optaxdist.transforms._start import fingerprint

    tree = {
        "f32": jnp.linspace(-1, 1, 50),
        "bf16": jnp.linspace(-1, 1, 7).astype(jnp.bfloat16),
        "i32": jnp.arange(9),
        "flag": jnp.asarray([True, False]),
    }
    base = np.asarray(fingerprint(tree))
    assert base.dtype == np.uint32 and base.shape == (4,)
    for key, leaf in tree.items():
        for i in range(leaf.size):
            changed = dict(tree)
            flat = leaf.reshape(-1)
            bumped = ~flat[i] if leaf.dtype == jnp.bool_ else flat[i] + jnp.asarray(1, leaf.dtype)
            changed[key] = flat.at[i].set(bumped).reshape(leaf.shape)
            assert not np.array_equal(np.asarray(fingerprint(changed)), base), (key, i)


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_bfloat16_parameters_get_float32_anchors(sharded):
    """Outer steps smaller than half a bfloat16 ulp accumulate in float32 anchors (the default);
    with anchor_dtype=None they are rounded away and the anchor never moves. Same bytes on the wire."""
    comm = od.AxisComm("replica")

    def run(**kw):
        tx = od.diloco(
            optax.sgd(0.01),
            optax.sgd(0.02, momentum=0.5),
            comm=comm,
            period=4,
            num_shards=2 if sharded else None,
            **kw,
        )

        def train(p):
            def body(carry, _):
                p, s = carry
                u, s = tx.update(jnp.ones_like(p), s, p)
                return (optax.apply_updates(p, u), s), None

            return jax.lax.scan(body, (p, tx.init(p)), None, length=40)[0]

        return jax.jit(jax.vmap(train, axis_name="replica"))(jnp.ones((2, 3), jnp.bfloat16))

    (p32, s32), (_, s16) = run(), run(anchor_dtype=None)
    a32, a16 = s32.sync_state.anchors[0], s16.sync_state.anchors[0]
    assert a32.dtype == jnp.float32 and a16.dtype == jnp.bfloat16
    if sharded:  # each replica's block of the padded flat anchor: the 3 elements, then padding
        a32, a16 = a32.reshape(-1)[:3], a16.reshape(-1)[:3]
    assert jax.tree.leaves(s32.sync_state.outer_states)[-1].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(a16, np.float32), 1.0)  # every outer step rounded away
    assert np.all(np.asarray(a32) < 0.995)  # ten outer steps of about 8e-4 each
    assert p32.dtype == jnp.bfloat16 and float(p32[0, 0]) < 1.0
    assert od.comm_stats(s32).by_kind == od.comm_stats(s16).by_kind


# on vmap, test_split_local_steps compares the programs bit for bit; it runs here in the full run
@pytest.mark.sample(harnesses=("vmap",))
def test_split_local_steps_computes_the_same(harness):
    """``split_local_steps=True`` on every harness (MPI and one process per node included): the
    local program runs on the local steps, the synchronization's on the synchronizations, and
    every number is the same as without it (momentum SGD at learning rates that are powers of two,
    inner and outer: no product rounds, see test_split_local_steps)."""
    outer = optax.sgd(0.5, momentum=0.5, nesterov=True)
    tx = od.diloco(optax.sgd(0.125, momentum=0.5), comm=harness.comm, period=3, warmup_steps=1, outer=outer)

    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state

    params = od.replicate({"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4)}, harness.n)
    state = harness.run(tx.init, params)
    keys = jax.random.split(jax.random.key(1), 8)
    grads = [{"w": random_normal(k, (harness.n, 3, 4))} for k in keys]
    expected, _ = harness.run_loop(step, (params, state), grads)
    got, split = harness.run_loop(step, (params, state), grads, split_local_steps=True)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_array_equal(b, a)
    # warm-up at 0 (and the start check), anchors at 1, syncs at s = 2, 5 (t = 3, 6)
    assert (split.local_calls, split.sync_calls) == (8 - 1 - 1 - 2, 2)
    # the local program, and the synchronization's, took only what they read and returned only
    # what they change
    assert [p is not None for p in split._pruned.values()] == [True, True]


def test_numpy_integers_and_bools_are_hyperparameters_like_python_ones():
    """A sweep's ``np.arange`` periods and NumPy flags configure a transform as Python ints and
    bools do."""
    comm = od.AxisComm("replica")
    params = od.replicate({"w": jnp.arange(3.0)}, 4)
    grads = jax.tree.map(lambda x: x * 0 + jnp.arange(4, dtype=x.dtype)[:, None], params)

    def run(tx):
        def step(p, g):
            u, s = tx.update(g, tx.init(p), p)
            return optax.apply_updates(p, u), s

        return od.simulate(step)(params, grads)

    want = run(od.local_sgd(optax.sgd(LR), comm=comm, period=1, average_inner_state=True))
    got = run(od.local_sgd(optax.sgd(LR), comm=comm, period=np.int64(1), average_inner_state=np.True_))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"average_inner_state='yes' must be a bool"):
        od.local_sgd(optax.sgd(LR), comm=comm, period=2, average_inner_state="yes")
    for bad in (np.int64(0), np.True_):  # NumPy 1 and 2 print them differently
        with pytest.raises(ValueError, match=re.escape(f"period={bad!r} must be an int ≥ 1")):
            od.diloco(optax.sgd(LR), comm=comm, period=bad)


def test_a_state_of_another_transform_is_named_as_such():
    comm = od.AxisComm("replica")
    params = od.replicate({"w": jnp.arange(3.0)}, 4)
    local = od.local_sgd(optax.sgd(LR), comm=comm, period=2)
    diloco = od.diloco(optax.sgd(LR), comm=comm, period=2)

    def update(tx, state):
        return od.simulate(lambda p, s: tx.update(p, s, p))(params, state)

    with pytest.raises(ValueError, match=r"local_sgd.update: the state's ledger counts .* another transform"):
        update(local, od.simulate(diloco.init)(params))
    with pytest.raises(TypeError, match=r"got a state of type tuple, not the PeriodicState"):
        update(diloco, od.simulate(optax.adam(LR).init)(params))
