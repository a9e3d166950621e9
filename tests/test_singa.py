"""SINGA SGD and ExponentialDecay against a NumPy transcription of SINGA's update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od


def np_singa_sgd(p, grads, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False):
    p = p.astype(np.float64)
    buf = np.zeros_like(p)
    for t, g in enumerate(grads):
        g = g + wd * p
        if momentum:
            buf = momentum * buf + (1 - dampening) * g
            g = g + momentum * buf if nesterov else buf
        p = p - lr(t) * g
    return p


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(momentum=0.9),
        dict(momentum=0.9, dampening=0.3),
        dict(momentum=0.5, nesterov=True, weight_decay=0.01),
    ],
)
def test_trajectory_matches_numpy(kw):
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=4).astype(np.float32)
    grads = rng.normal(size=(12, 4)).astype(np.float32)
    sched = optax.exponential_decay(0.1, transition_steps=5, decay_rate=0.5, staircase=True)
    tx = od.singa_sgd(sched, **kw)

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (jnp.asarray(p0), tx.init(jnp.asarray(p0))), grads)
    want = np_singa_sgd(
        p0,
        grads,
        lambda t: 0.1 * 0.5 ** (t // 5),
        kw.get("momentum", 0.0),
        kw.get("dampening", 0.0),
        kw.get("weight_decay", 0.0),
        kw.get("nesterov", False),
    )
    np.testing.assert_allclose(p, want, rtol=1e-5, atol=1e-6)


def test_first_step_dampening_differs_from_torch_style_sgd():
    g = jnp.asarray([1.0, -2.0])
    p = jnp.zeros(2)
    singa = od.singa_sgd(0.1, momentum=0.9, dampening=0.25)
    u, _ = singa.update(g, singa.init(p), p)
    torch_like = optax.sgd(0.1, momentum=0.9)  # buffer starts at g, no dampening on step 1
    v, _ = torch_like.update(g, torch_like.init(p), p)
    np.testing.assert_allclose(u, 0.75 * v, rtol=1e-6)
    no_damp = od.singa_sgd(0.1, momentum=0.9)
    w, _ = no_damp.update(g, no_damp.init(p), p)
    np.testing.assert_allclose(w, v, rtol=1e-6)


def test_bad_hyperparameters():
    with pytest.raises(ValueError, match="momentum"):
        od.singa_sgd(0.1, momentum=-1.0)
    with pytest.raises(ValueError, match="weight_decay"):
        od.singa_sgd(0.1, weight_decay=-1.0)
    with pytest.raises(ValueError, match="nesterov"):
        od.singa_sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="nesterov"):
        od.singa_sgd(0.1, momentum=0.9, dampening=0.1, nesterov=True)


def test_schedule_with_bf16_params_under_strict_promotion():
    tx = od.singa_sgd(optax.exponential_decay(0.1, transition_steps=10, decay_rate=0.5), momentum=0.9)
    p = jnp.ones(3, jnp.bfloat16)
    u, _ = tx.update(p, tx.init(p), p)
    assert u.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(u, np.float32), -0.1, rtol=1e-2)
