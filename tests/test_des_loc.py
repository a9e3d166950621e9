"""DES-LOC: local steps; parameters and each optimizer-state moment averaged on their own periods."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.transforms.des_loc import _occurring
from tests.harness import VmapHarness
from tests.problems import init_params, np_grad, replica_data
from tests.test_allreduce import LR, run_trajectory
from tests.test_local_sgd import close, sync_stats
from tests.test_local_step_cost import _all_eqns, _is_float_collective, _sub_jaxprs, unconditional_eqns

STEPS = 12
BETA = 0.9
B1, B2, EPS = 0.9, 0.99, 1e-8
P_BYTES = 4 * (3 * 2 + 2)  # w (3, 2) and b (2,) in float32


def trajectory(harness, tx_factory):
    return run_trajectory(harness, tx_factory, steps=STEPS)


def adam(lr=LR):
    return optax.adam(lr, b1=B1, b2=B2, eps=EPS)


def np_des_loc(n, inner, period, state_periods, steps=STEPS, lr=LR):
    """NumPy transcription: each replica's local step (SGD with momentum, or Adam), then the
    parameters averaged when ``period`` divides the step count and each named moment when its
    own period does."""
    params = [{k: v.astype(np.float64) for k, v in init_params().items()} for _ in range(n)]
    zeros = {k: np.zeros_like(v) for k, v in params[0].items()}
    names = ("trace",) if inner == "momentum" else ("mu", "nu")
    state = [{name: dict(zeros) for name in names} for _ in range(n)]
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        for i in range(n):
            g, s = np_grad(params[i], xs[t, i], ys[t, i]), state[i]
            if inner == "momentum":
                s["trace"] = {k: g[k] + BETA * s["trace"][k] for k in g}
                step = {k: lr * s["trace"][k] for k in g}
            else:
                s["mu"] = {k: B1 * s["mu"][k] + (1 - B1) * g[k] for k in g}
                s["nu"] = {k: B2 * s["nu"][k] + (1 - B2) * g[k] ** 2 for k in g}
                mu_hat = {k: s["mu"][k] / (1 - B1 ** (t + 1)) for k in g}
                nu_hat = {k: s["nu"][k] / (1 - B2 ** (t + 1)) for k in g}
                step = {k: lr * mu_hat[k] / (np.sqrt(nu_hat[k]) + EPS) for k in g}
            params[i] = {k: params[i][k] - step[k] for k in g}
        if (t + 1) % period == 0:
            mean = {k: sum(p[k] for p in params) / n for k in zeros}
            params = [dict(mean) for _ in range(n)]
        for name, k_f in state_periods.items():
            if (t + 1) % k_f == 0:
                mean = {k: sum(s[name][k] for s in state) / n for k in zeros}
                for s in state:
                    s[name] = dict(mean)
    return {k: np.stack([p[k] for p in params]) for k in zeros}


def test_momentum_matches_numpy_and_the_ledger(harness):
    """Parameters every 2 steps, the momentum every 3: steps 3 and 9 average the momentum only."""
    params, state = trajectory(
        harness,
        lambda c: od.des_loc(optax.sgd(LR, momentum=BETA), comm=c, period=2, state_periods={"trace": 3}),
    )
    close(params, np_des_loc(harness.n, "momentum", 2, {"trace": 3}))
    assert sync_stats(state) == {
        "param_average[float32]": od.KindTotals(6, 6 * P_BYTES),
        "state_average[trace,float32]": od.KindTotals(4, 4 * P_BYTES),
    }
    # step 12 ran the third synchronization: masks 0b01 (parameters), 0b10 (momentum), 0b11 (both)
    assert np.unique(state.last_sync).tolist() == [3]


def test_adam_with_the_papers_multiples_matches_numpy_and_the_ledger(harness):
    periods = {"mu": 6, "nu": 12}  # 3× and 6× the parameter period
    with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
        params, state = trajectory(
            harness, lambda c: od.des_loc(adam(), comm=c, period=2, state_periods=periods)
        )
    close(params, np_des_loc(harness.n, "adam", 2, periods))
    counts = [x for x in jax.tree.leaves(state.inner_state) if x.dtype == np.int32]
    assert [np.unique(c).tolist() for c in counts] == [[STEPS]]  # Adam's count: never averaged
    assert sync_stats(state) == {
        "param_average[float32]": od.KindTotals(6, 6 * P_BYTES),
        "state_average[mu,float32]": od.KindTotals(2, 2 * P_BYTES),
        "state_average[nu,float32]": od.KindTotals(1, P_BYTES),
    }
    mu, nu = state.inner_state[0].mu, state.inner_state[0].nu  # step 12 averaged both
    for leaf in jax.tree.leaves((mu, nu)):
        np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[0], leaf.shape))


@pytest.mark.parametrize("inner", [pytest.param("momentum", marks=pytest.mark.slow), "adam"])
def test_every_period_equal_is_local_adam(inner):
    """All state periods = period: local_sgd(average_inner_state=True), bit for bit."""
    harness = VmapHarness(8)
    opt, periods = (
        (optax.sgd(LR, momentum=BETA), {"trace": 3}) if inner == "momentum" else (adam(), {"mu": 3, "nu": 3})
    )
    with jax.numpy_dtype_promotion("standard"):
        a, sa = trajectory(harness, lambda c: od.des_loc(opt, comm=c, period=3, state_periods=periods))
        b, sb = trajectory(harness, lambda c: od.local_sgd(opt, comm=c, period=3, average_inner_state=True))
    for x, y in zip(jax.tree.leaves((a, sa.inner_state)), jax.tree.leaves((b, sb.inner_state))):
        np.testing.assert_array_equal(x, y)
    state_bytes = sum(t.bytes for k, t in sync_stats(sa).items() if k.startswith("state_average"))
    assert state_bytes == sync_stats(sb)["inner_state_average[float32]"].bytes


def test_state_periods_beyond_the_run_are_local_sgd():
    harness = VmapHarness(8)
    far = {"mu": 10**6, "nu": 10**6}
    with jax.numpy_dtype_promotion("standard"):
        a, sa = trajectory(harness, lambda c: od.des_loc(adam(), comm=c, period=4, state_periods=far))
        b, sb = trajectory(harness, lambda c: od.local_sgd(adam(), comm=c, period=4))
    for x, y in zip(jax.tree.leaves((a, sa.inner_state)), jax.tree.leaves((b, sb.inner_state))):
        np.testing.assert_array_equal(x, y)
    stats = sync_stats(sa)
    assert stats["param_average[float32]"] == sync_stats(sb)["param_average[float32]"]
    assert (
        stats["state_average[mu,float32]"].collectives == stats["state_average[nu,float32]"].collectives == 0
    )


def test_schedule_has_one_branch_per_combination_that_occurs():
    assert _occurring([2, 6, 12]) == [0b001, 0b011, 0b111]  # paper's multiples: no state-only step
    assert _occurring([2, 3]) == [0b01, 0b10, 0b11]
    assert _occurring([4, 2]) == [0b10, 0b11]  # every parameter average is also a state average


def _switches(jaxpr):
    """Every cond/switch equation, at any depth."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":
            yield eqn
        for sub in _sub_jaxprs(eqn):
            yield from _switches(sub)


@pytest.mark.parametrize("where", ["simulate", "mesh"])
def test_a_local_step_sends_nothing(where):
    """The step's program: no collective outside the branches, none in the local step's branch, and
    one branch per combination of averages (parameters; + mu; + mu and nu)."""
    n, comm = 4, od.AxisComm(od.REPLICA_AXIS)
    tx = od.des_loc(
        optax.sgd(0.1, momentum=0.9), comm=comm, period=2, state_periods={"trace": 6}, nonfinite="ignore"
    )

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    params = od.replicate({"w": jnp.ones((8, 4)), "b": jnp.zeros(4)}, n)
    if where == "simulate":
        init, run = od.simulate(tx.init), od.simulate(step)
    else:
        auto = (jax.sharding.AxisType.Auto,)
        mesh = jax.make_mesh((n,), (od.REPLICA_AXIS,), devices=jax.devices()[:n], axis_types=auto)
        init, run = od.on_mesh(tx.init, mesh), od.on_mesh(step, mesh)
    jaxpr = jax.make_jaxpr(run)(params, init(params), params).jaxpr
    assert not [e for e in unconditional_eqns(jaxpr) if _is_float_collective(e)]
    engine = max(_switches(jaxpr), key=lambda e: len(e.params["branches"]))
    branches = engine.params["branches"]
    assert len(branches) == 3  # local; parameters; parameters and momentum
    sends = [sum(_is_float_collective(e) for e in _all_eqns(b.jaxpr)) for b in branches]
    assert sends[0] == 0 and sends[1] > 0 and sends[2] > sends[1]


def test_bad_settings_fail_with_clear_errors():
    comm = od.AxisComm("replica")
    inner = optax.sgd(0.1, momentum=0.9)
    with pytest.raises(ValueError, match="period=0 must be an int ≥ 1"):
        od.des_loc(inner, comm=comm, period=0, state_periods={"trace": 2})
    with pytest.raises(ValueError, match=r"state_periods\['trace'\]=0 must be an int ≥ 1"):
        od.des_loc(inner, comm=comm, period=2, state_periods={"trace": 0})
    with pytest.raises(ValueError, match=r"state_periods\['trace'\]=1.5 must be an int"):
        od.des_loc(inner, comm=comm, period=2, state_periods={"trace": 1.5})
    with pytest.raises(
        TypeError, match=r"state_periods must map state field names to periods, e.g. \{'mu': 6"
    ):
        od.des_loc(inner, comm=comm, period=2, state_periods=6)
    params = {"w": jnp.ones(3)}
    tx = od.des_loc(inner, comm=comm, period=2, state_periods={"mu": 6})
    with pytest.raises(ValueError, match=r"state_periods names \['mu'\].*allowed: \['trace'\]"):
        tx.init(params)
    tx = od.des_loc(adam(), comm=comm, period=2, state_periods={"count": 6, "nu": 12})
    with pytest.raises(ValueError, match=r"names \['count'\].*floating-point.*allowed: \['mu', 'nu'\]"):
        tx.init(params)
    injected = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)
    tx = od.des_loc(injected, comm=comm, period=2, state_periods={"inner_state": 4, "nu": 12})
    with pytest.raises(ValueError, match=r"nested fields \['inner_state', 'nu'\]"):
        tx.init(params)


def test_fields_are_found_inside_chains_and_injected_hyperparameters():
    comm = od.AxisComm("replica")
    inner = optax.chain(
        optax.clip_by_global_norm(1.0), optax.inject_hyperparams(optax.adamw)(learning_rate=0.1)
    )
    tx = od.des_loc(inner, comm=comm, period=2, state_periods={"mu": 6, "nu": 12}, check_start=False)
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init({"w": jnp.ones((3, 2)), "b": jnp.ones(2, jnp.bfloat16)})
    assert dict(zip(state.ledger.kinds, state.ledger.payloads)) == {
        "param_average[bfloat16+float32]": 6 * 4 + 2 * 2,
        "state_average[mu,bfloat16+float32]": 6 * 4 + 2 * 2,
        "state_average[nu,bfloat16+float32]": 6 * 4 + 2 * 2,
    }


def test_a_state_only_average_returns_the_local_steps_update():
    """On a step that averages the momentum only, the update is the local step's, not
    ``(params + update) − params`` (which differs by a rounding)."""
    comm, n = od.AxisComm(od.REPLICA_AXIS), 4
    inner = optax.sgd(0.1, momentum=0.9)
    state_only = od.des_loc(inner, comm=comm, period=10**6, state_periods={"trace": 1})
    local = od.local_sgd(inner, comm=comm, period=10**6)
    params = od.replicate({"w": jnp.linspace(0.3, 7.1, 64)}, n)
    grads = {"w": jnp.full((n, 64), 0.5)}  # the same on every replica: the average changes nothing

    def updates(tx):
        return od.simulate(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads)

    a, b = updates(state_only), updates(local)
    np.testing.assert_array_equal(a["w"], b["w"])
    assert not np.array_equal((params["w"] + b["w"]) - params["w"], b["w"])  # the rounding exists


def test_an_overflowing_second_moment_skips_that_step_and_never_reaches_another_replica():
    """A finite gradient of 1e20 overflows Adam's second moment (its square is beyond float32)
    while the update stays finite (``mu / sqrt(inf) = 0``): the guard sees the state, skips that
    replica's step, and no moment average carries an ``inf`` to the others."""
    n, bad = 4, 2
    tx = od.des_loc(adam(1e-2), comm=od.AxisComm("replica"), period=2, state_periods={"mu": 4, "nu": 4})

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return od.apply_updates(p, u, s), s

    params = od.replicate(jnp.ones(3), n)
    state = od.simulate(tx.init)(params)
    run = od.simulate(step)
    for t in range(8):
        g = jnp.ones((n, 3)).at[bad, 0].set(1e20 if t == 1 else 1.0)
        before = state
        with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
            params, state = run(params, state, g)
        if t == 1:  # the poisoned replica kept its moments; the others took their step
            for name in ("mu", "nu"):
                now, then = getattr(state.inner_state[0], name), getattr(before.inner_state[0], name)
                np.testing.assert_array_equal(now[bad], then[bad])
                assert not np.array_equal(np.delete(now, bad, 0), np.delete(then, bad, 0))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact))
    assert np.isfinite(params).all() and (params[:, 0] < params[0, 0] + 1).all()
    assert len(set(np.asarray(params[:, 0]).tolist())) == 1  # agreed at the last sync, still moving
    assert params[0, 0] < 1 - 5 * 1e-2


def test_a_scalar_kept_infinite_on_purpose_does_not_skip_every_step():
    """``reduce_on_plateau`` keeps a best value of ``inf`` until its first 3 losses are in: a state
    scalar, which the guard does not check (with the state averaged it checks the update and the
    state's arrays), so the local steps are taken."""
    inner = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau(accumulation_size=3))
    tx = od.local_sgd(inner, comm=od.AxisComm("replica"), period=2, average_inner_state=True)

    def step(p, s, g):
        u, s = tx.update(g, s, p, value=jnp.sum(p))
        return od.apply_updates(p, u, s), s

    params = od.replicate(jnp.ones(3), 2)
    state = od.simulate(tx.init)(params)
    with jax.numpy_dtype_promotion("standard"):  # reduce_on_plateau's scale
        params, state = od.simulate(step)(params, state, jnp.ones((2, 3)))
    np.testing.assert_allclose(params, 0.9)


def test_an_overflowing_moment_of_a_scalar_parameter_is_caught_too():
    """A scalar parameter's second moment is a scalar of the state: it counts when it turns
    non-finite (``local_sgd(average_inner_state=True)`` averages it at the next sync)."""
    n, bad = 4, 2
    tx = od.local_sgd(adam(1e-2), comm=od.AxisComm("replica"), period=2, average_inner_state=True)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return od.apply_updates(p, u, s), s

    params = od.replicate({"w": jnp.ones(3), "t": jnp.ones(())}, n)
    state = od.simulate(tx.init)(params)
    run = od.simulate(step)
    for t in range(4):
        g = {"w": jnp.ones((n, 3)), "t": jnp.ones(n).at[bad].set(1e20 if t == 1 else 1.0)}
        with jax.numpy_dtype_promotion("standard"):  # optax.adam's bias correction
            params, state = run(params, state, g)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact))
    assert len(set(np.asarray(params["t"]).tolist())) == 1 and params["t"][0] < 1 - 3e-2
