"""The one-time start check: fingerprints see every bit, and its host callback cannot deadlock."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist.transforms._start import fingerprint

ROOT = Path(__file__).resolve().parents[1]


def test_fingerprint_reads_every_bit_of_8_byte_values():
    with jax.enable_x64(True):
        a = fingerprint([jnp.asarray([0.1, 0.2], jnp.float64)])
        b = fingerprint([jnp.asarray([0.3, 0.4], jnp.float64)])
        assert not np.array_equal(np.asarray(a), np.asarray(b))
        x = jnp.linspace(-1.0, 1.0, 9, dtype=jnp.float64)
        base = np.asarray(fingerprint([x]))
        for i in range(x.size):  # one ulp anywhere (the low word) changes it
            bumped = x.at[i].set(jnp.nextafter(x[i], jnp.asarray(2.0, jnp.float64)))
            assert not np.array_equal(np.asarray(fingerprint([bumped])), base), i
        i64 = jnp.arange(5, dtype=jnp.int64)
        assert not np.array_equal(
            np.asarray(fingerprint([i64])), np.asarray(fingerprint([i64.at[2].add(1 << 40)]))
        )
        c = jnp.asarray([1 + 2j, 3 - 1j], jnp.complex64)
        assert not np.array_equal(np.asarray(fingerprint([c])), np.asarray(fingerprint([c.at[1].add(1j)])))


NNX_DILOCO = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import optaxdist as od

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(16, 32, rngs=rngs)
            self.b = nnx.Linear(32, 4, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    n = 4
    graphdef, params = nnx.split(Mlp(nnx.Rngs(0)), nnx.Param)
    comm = od.AxisComm("replica")
    tx = od.diloco(optax.adam(1e-3), comm=comm, period=10)

    def train_step(params, opt_state, x, y):
        def loss(p):
            return jnp.mean((nnx.merge(graphdef, p)(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = od.replicate(params, n)
    opt_state = jax.vmap(tx.init)(params)
    step = od.simulate(train_step)
    key = jax.random.key(1)
    for t in range(300):
        key, kx = jax.random.split(key)
        x = jax.random.normal(kx, (n, 8, 16))
        params, opt_state, value = step(params, opt_state, x, jnp.tanh(x[..., :4]))
        log = float(jnp.mean(value))  # computing with JAX between steps, as users log
    print("finished", log)
    """
)


def test_nnx_diloco_under_simulate_finishes():
    """A diloco run under simulate with an NNX model, logging with jnp between steps, hung on
    main in about 1 of 3 runs (the start check's callback ran on every step and computed with
    JAX). Now the callback runs at step 0 only and uses NumPy. A hard timeout, never a hang."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-c", NNX_DILOCO], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished" in proc.stdout
