"""mlbench SignSGD and the (a+t)²-weighted averaged iterate against NumPy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od


def np_sign_sgd(p, grads, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False):
    p = p.astype(np.float64)
    buf = None
    for g in grads:
        d = g + wd * p
        if momentum:
            buf = d.copy() if buf is None else momentum * buf + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        p = p - lr * np.sign(d)
    return p


@pytest.mark.parametrize(
    "kw", [dict(), dict(momentum=0.9, dampening=0.2), dict(momentum=0.5, nesterov=True, weight_decay=0.1)]
)
def test_sign_sgd_matches_numpy(kw):
    rng = np.random.default_rng(0)
    p0 = rng.normal(size=6).astype(np.float32)
    grads = rng.normal(size=(9, 6)).astype(np.float32)
    grads[2, 1] = 0.0
    tx = od.sign_sgd(0.01, **kw)

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), None

    (p, _), _ = jax.lax.scan(body, (jnp.asarray(p0), tx.init(jnp.asarray(p0))), grads)
    want = np_sign_sgd(
        p0,
        grads,
        0.01,
        kw.get("momentum", 0.0),
        kw.get("dampening", 0.0),
        kw.get("weight_decay", 0.0),
        kw.get("nesterov", False),
    )
    np.testing.assert_allclose(p, want, atol=1e-6)


def test_averaged_iterate_equals_weighted_average():
    a, steps = 7.5, 12
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=4).astype(np.float32)
    grads = rng.normal(size=(steps, 4)).astype(np.float32)
    tx = optax.chain(optax.sgd(0.1), od.averaged_iterate(a))

    def body(carry, g):
        p, s = carry
        u, s = tx.update(g, s, p)
        p = optax.apply_updates(p, u)
        return (p, s), p

    (_, s), iterates = jax.lax.scan(body, (jnp.asarray(p0), tx.init(jnp.asarray(p0))), grads)
    w = (a + np.arange(steps)) ** 2
    want = (w[:, None] * np.asarray(iterates, np.float64)).sum(0) / w.sum()
    np.testing.assert_allclose(od.averaged_params(s), want, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="nesterov"):
        od.sign_sgd(0.1, nesterov=True)
    with pytest.raises(ValueError, match="momentum"):
        od.sign_sgd(0.1, momentum=-0.1)
    with pytest.raises(ValueError, match="shift"):
        od.averaged_iterate(0.0)
    with pytest.raises(ValueError, match="found 0"):
        od.averaged_params(optax.sgd(0.1).init(jnp.zeros(2)))


def test_sign_sgd_schedule_with_bf16_params():
    tx = od.sign_sgd(optax.exponential_decay(0.1, 10, 0.5), momentum=0.9)
    p = jnp.ones(3, jnp.bfloat16)
    u, _ = tx.update(-p, tx.init(p), p)
    assert u.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(u, np.float32), 0.1, rtol=1e-2)
