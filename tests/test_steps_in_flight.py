"""Steps queued on a mesh of CPU devices: XLA:CPU's in-process collectives deadlock when many steps
are in flight, so ``on_mesh`` keeps one there. A hard timeout, never a hang."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.parallel.harness import _one_step_in_flight

ROOT = Path(__file__).resolve().parents[1]

# 400 steps dispatched without reading a result: without the wait this aborted in XLA's rendezvous
# on 2 cores (JAX 0.10.2; docs/harnesses.md); with it the loop takes about 3 s.
QUEUED_STEPS = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    import optaxdist as od

    mesh = jax.make_mesh((2, 4), ("node", "local"))

    def step(x, m):
        m = 0.9 * m + 0.01 * jnp.tanh(x)
        return jax.lax.pmean(x - m, "local"), m

    run = od.on_mesh(step, mesh, donate_argnums=(0, 1))
    x, m = jnp.ones((8, 100_000)), jnp.zeros((8, 100_000))
    for _ in range(400):
        x, m = run(x, m)
    print("finished", float(np.asarray(x).sum()))
    """
)


def test_steps_queued_on_a_cpu_mesh_finish():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run(
        [sys.executable, "-c", QUEUED_STEPS], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished" in proc.stdout


def test_a_step_on_several_cpu_devices_returns_ready_results():
    mesh = jax.make_mesh((8,), ("replica",))
    assert _one_step_in_flight(mesh)
    run = od.on_mesh(lambda x: jax.lax.psum(jnp.tanh(x) @ x.T, "replica"), mesh)
    out = run(jnp.ones((8, 256, 256)))
    assert out.is_ready()
    np.testing.assert_allclose(np.asarray(out)[0], 8 * np.tanh(1.0) * 256 * np.ones((256, 256)), rtol=1e-5)


def test_one_device_of_a_mesh_per_process_keeps_steps_queued():
    assert not _one_step_in_flight(jax.make_mesh((1,), ("replica",), devices=jax.devices()[:1]))


def test_a_step_on_an_abstract_mesh_of_cpu_devices_waits():
    mesh = jax.make_mesh((8,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    run = od.on_mesh(lambda x: jax.lax.psum(x, "replica"), mesh.abstract_mesh)
    with jax.set_mesh(mesh):
        out = run(jnp.ones((8, 3)))
    assert out.is_ready()
    np.testing.assert_array_equal(np.asarray(out), 8 * np.ones((8, 3)))


def _refuse_large(grads: np.ndarray) -> np.ndarray:
    """A host check of a replica's gradients (the user's, in the step)."""
    if np.abs(grads).max() > 1.0:
        raise ValueError("gradient too large")
    return np.zeros((), np.float32)


def _split_local_sgd(check: bool = False, **options):
    """``local_sgd`` (period 3) on 4 CPU devices under ``split_local_steps``, and its ``init``. With
    ``check`` the step checks its gradients on the host (``_refuse_large``) in every program."""
    mesh = jax.make_mesh((4,), (od.REPLICA_AXIS,), devices=jax.devices()[:4])
    tx = od.local_sgd(optax.sgd(0.1), comm=od.AxisComm(od.REPLICA_AXIS), period=3)

    def step(params, state, grads):
        if check:
            grads = grads + jax.pure_callback(_refuse_large, jax.ShapeDtypeStruct((), jnp.float32), grads)
        updates, state = tx.update(grads, state, params)
        return od.apply_updates(params, updates, state), state

    return od.on_mesh(step, mesh, split_local_steps=True, **options), od.on_mesh(tx.init, mesh)


def test_every_call_of_a_split_step_on_several_cpu_devices_returns_ready_results():
    """``split_local_steps`` dispatches its program, does the host's part of the call, then waits:
    the general, local and synchronization calls all return ready results, as ``on_mesh`` does
    (without the wait, every call but the first returned before its results were ready: a million
    parameters per replica take longer than a dispatch)."""
    split, init = _split_local_sgd(donate_argnums=(0, 1))
    params = od.replicate(jnp.linspace(-1.0, 1.0, 1_000_000), 4)
    state = init(params)
    for i in range(7):
        params, state = split(params, state, jnp.full((4, 1_000_000), 0.01 * (i + 1)))
        assert all(x.is_ready() for x in jax.tree.leaves((params, state))), i
    assert split.local_calls >= 3 and split.sync_calls >= 1


def test_a_split_call_whose_program_fails_at_the_wait_counts_nothing():
    """A host callback's error surfaces at the call's final wait: at a local call (the step's own
    check of its gradients) and at a general one (the start check). Neither leaves a call or
    control values counted."""
    split, init = _split_local_sgd(check=True)
    start = od.replicate(jnp.linspace(-1.0, 1.0, 64), 4)
    params, state = split(start, init(start), jnp.full((4, 64), 0.01))  # the general program
    before = (split.local_calls, split.sync_calls), dict(split._counted)
    split(params, state, jnp.full((4, 64), 0.02))
    assert (split.local_calls, split.sync_calls) == (before[0][0] + 1, before[0][1])  # a local call
    counts, counted = (split.local_calls, split.sync_calls), dict(split._counted)
    with pytest.raises(Exception, match="gradient too large"):
        split(params, state, jnp.full((4, 64), 2.0))  # the same local call, failing
    assert (split.local_calls, split.sync_calls) == counts
    assert split._counted == counted
    # a new run with the first run's signature: the harness knows its plan, so the call goes
    # through the split harness's own dispatch and wait (not the general program's first call)
    differ = start + jnp.arange(4.0)[:, None] * 0.1
    with pytest.raises(Exception, match="replicas do not start from identical parameters"):
        split(differ, init(differ), jnp.full((4, 64), 0.0))
    assert (split.local_calls, split.sync_calls) == counts
    assert split._counted == counted
