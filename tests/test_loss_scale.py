"""Dynamic loss scaling: non-finite values on one replica make every replica skip together."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import grad_fn, init_params, replica_data

LR = 0.1


def scan_steps(tx, params, xs, ys, poison):
    """Run len(xs) steps; ``poison[t]`` (per replica) multiplies the gradient by NaN/Inf or 1."""
    state = tx.init(params)

    def body(carry, inp):
        p, s = carry
        x, y, bad = inp
        g = grad_fn(p, x, y)
        g = jax.tree.map(lambda v: v * bad, g)
        u, s2 = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s2), (p, s, s2)

    (p, s), trace = jax.lax.scan(body, (params, state), (xs, ys, poison))
    return p, s, trace


def test_nonfinite_on_one_replica_skips_everywhere(harness):
    n, steps = harness.n, 10
    bad_steps = {3: np.nan, 7: np.inf}
    poison = np.ones((n, steps), np.float32)
    for t, v in bad_steps.items():
        poison[(t % n), t] = v  # a different replica each time
    xs, ys = replica_data(n, steps)
    comm = harness.comm
    tx = od.dynamic_loss_scale(
        optax.chain(od.allreduce(comm=comm), optax.sgd(LR, momentum=0.9)),
        comm=comm,
        init_scale=8.0,
        growth_interval=4,
    )
    params0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)
    run = lambda p, x, y, b: scan_steps(tx, p, x, y, b)
    p, s, (p_before, s_before, s_after) = harness.run(
        run, params0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1), poison
    )
    assert np.isfinite(p["w"]).all()
    od.assert_replicas_identical(p)
    for t in bad_steps:
        # parameters and the inner optimizer state unchanged on every replica
        np.testing.assert_array_equal(p_before["w"][:, t + 1], p_before["w"][:, t])
        inner_before = jax.tree.leaves(s_before.inner_state)
        inner_after = jax.tree.leaves(s_after.inner_state)
        momentum_leaves = [(a, b) for a, b in zip(inner_before, inner_after) if a.dtype == np.float32]
        assert momentum_leaves
        for a, b in momentum_leaves:
            np.testing.assert_array_equal(a[:, t], b[:, t])
    # scale: ×2 after 4 consecutive finite steps, ÷2 on each overflow
    scales = s_after.loss_scale[0]
    want, good = [], 0
    scale = 8.0
    for t in range(steps):
        if t in bad_steps:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == 4:
                scale, good = scale * 2, 0
        want.append(scale)
    np.testing.assert_array_equal(scales, want)
    assert (s.skipped_steps == len(bad_steps)).all()
    # the skipped steps still ran (and counted) their all-reduce, plus one agreement each step
    stats = od.comm_stats(s)
    assert stats.by_kind["all_reduce[float32]"].collectives == steps
    assert stats.by_kind["agree[int32]"] == od.KindTotals(steps, 4 * steps)


def test_fp16_wire_overflow_is_caught(harness):
    """The local gradients are finite but their fp16 sum overflows (SINGA's half mode: sum, then
    divide): every replica skips."""
    n, comm = harness.n, harness.comm
    half = od.allreduce(comm=comm, dtype="float16", divide_before=False)
    tx = od.skip_nonfinite(optax.chain(half, optax.sgd(1.0)), comm=comm)
    g = np.full((n, 3), 60000.0, np.float32)
    params = np.zeros((n, 3), np.float32)
    upd, state = harness.run(lambda gg, p: tx.update(gg, tx.init(p), p), g, params)
    np.testing.assert_array_equal(upd, 0.0)
    assert (state.skipped_steps == (1 if n > 1 else 0)).all()


def np_mlbench_scaler(overflows, init=1024.0, factor=2.0, window=128):
    """mlbench DynamicLossScaler, transcribed: iter from 0, last_overflow = -1."""
    scale, last_overflow, out = init, -1, []
    for it, overflow in enumerate(overflows):
        if overflow:
            scale, last_overflow = scale / factor, it
        elif (it - last_overflow) % window == 0:
            scale = scale * factor
        out.append(scale)
    return out


def test_mlbench_preset_matches_mlbench_rule():
    rng = np.random.default_rng(0)
    overflows = rng.random(700) < 0.004
    overflows[[5, 300, 301]] = True
    tx = od.mlbench_loss_scale(optax.sgd(LR))
    p = jnp.zeros(2)

    def body(s, bad):
        g = jnp.where(bad, jnp.nan, 1.0) * jnp.ones(2)
        _, s = tx.update(g, s, p)
        return s, s.loss_scale

    _, scales = jax.jit(lambda: jax.lax.scan(body, tx.init(p), jnp.asarray(overflows)))()
    np.testing.assert_array_equal(np.asarray(scales), np_mlbench_scaler(overflows))


def test_mlbench_preset_raises_at_min_scale():
    tx = od.mlbench_loss_scale(optax.sgd(LR), init_scale=4e-4)
    p = jnp.zeros(2)
    update = jax.jit(lambda s: tx.update(jnp.full(2, jnp.nan), s, p)[1])
    s = update(tx.init(p))  # 4e-4 -> 2e-4: fine
    with pytest.raises(Exception, match="Minimum loss scale reached"):
        jax.block_until_ready(update(update(s)))


def test_default_scale_is_pytorchs_and_clamps():
    tx = od.dynamic_loss_scale(optax.sgd(LR), min_scale=1.0, init_scale=2.0)
    assert float(od.dynamic_loss_scale(optax.sgd(LR)).init(jnp.zeros(1)).loss_scale) == 2.0**16
    p = jnp.zeros(2)
    s = tx.init(p)
    for _ in range(3):
        _, s = tx.update(jnp.full(2, jnp.inf), s, p)
    assert float(s.loss_scale) == 1.0


def test_scale_loss_and_unscaling():
    tx = od.dynamic_loss_scale(optax.sgd(1.0), init_scale=1024.0)
    p = jnp.asarray([1.0, 2.0])
    s = tx.init(p)
    loss = lambda q: jnp.sum(q**2)
    g = jax.grad(lambda q: od.scale_loss(loss(q), s))(p)
    np.testing.assert_array_equal(g, 1024.0 * 2 * p)
    u, _ = tx.update(g, s, p)
    np.testing.assert_array_equal(u, -2 * p)
    with pytest.raises(ValueError, match="found 0"):
        od.scale_loss(loss(p), optax.sgd(1.0).init(p))


def test_bf16_params_keep_dtype():
    tx = od.dynamic_loss_scale(optax.sgd(LR))
    p = jnp.ones(3, jnp.bfloat16)
    u, s = tx.update(jnp.ones(3, jnp.bfloat16) * 1024, tx.init(p), p)
    assert u.dtype == jnp.bfloat16 and s.loss_scale.dtype == jnp.float32


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(growth_interval=0), "growth_interval"),
        (dict(init_scale=0.0), "init_scale"),
        (dict(growth_factor=0.5), "growth_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(min_scale=0.0), "min_scale"),
        (dict(max_scale=1.0), "max_scale"),
    ],
)
def test_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        od.dynamic_loss_scale(optax.sgd(LR), **kwargs)
