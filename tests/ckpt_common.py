"""What the checkpoint and elastic tests share: every public transform of the contract suite
(tests/test_contract.py's factories, built for a given communicator and world size), one train step
on the least-squares problem, and exact comparison of trees."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax

import optaxdist as od
import tests.test_contract as contract
from tests.problems import grad_fn, init_params, replica_data


def _composed(comm, n):
    """A composition: DiLoCo whose pseudo-gradients go through top-k with error feedback (a
    per-replica residual inside a replicated outer state), under loss scaling, in a chain."""
    del n
    reducer = od.compressed_allreduce(od.compress.top_k(fraction=0.5), comm=comm)
    inner = od.diloco(optax.sgd(0.05, momentum=0.9), comm=comm, period=2, reducer=reducer)
    return optax.chain(optax.clip_by_global_norm(10.0), od.dynamic_loss_scale(inner, comm=comm))


EXTRA = {"composed_diloco_top_k": _composed}
NAMES = sorted(contract.TRANSFORMS) + sorted(EXTRA)
# One transform per kind of state, run by default; the others are marked slow (on 2 loaded cores
# each transform costs 2-11 s of compilation per harness and world size).
FAST = (
    "allreduce",  # replicated ledger only
    "compressed_top_k",  # per-replica error-feedback residuals
    "powersgd",  # replicated Q, per-replica residuals
    "slowmo_memory_efficient",  # anchor and outer state sharded over the replicas
    "sgp_overlap",  # push-sum weights and mass in flight
    "dynamic_loss_scale",  # nested states, replicated loss scale
    "composed_diloco_top_k",  # per-replica inner momentum; a residual inside DiLoCo's reducer
)
K = 3  # save at step K, continue to 2K (DASO's epochs are 2 batches: see elastic_steps)


@contextlib.contextmanager
def _contract_globals(comm, n):
    """The contract factories read the module globals COMM (their communicator) and N (ring size,
    SlowMo's num_shards) when called: build them for another communicator / world size."""
    saved = contract.COMM, contract.N
    contract.COMM, contract.N = comm, n
    try:
        yield
    finally:
        contract.COMM, contract.N = saved


def fast_or_slow(names=NAMES, fast=FAST) -> list:
    """pytest params: the names in ``fast`` run by default, the others are marked slow."""
    import pytest

    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in names]


def make(name: str, comm, n: int) -> optax.GradientTransformationExtraArgs:
    if name in EXTRA:
        return EXTRA[name](comm, n)
    with _contract_globals(comm, n):
        return contract.TRANSFORMS[name][0]()


def step_fn(tx):
    """One replica's train step on its batch (``value=`` feeds DASO's plateau detector)."""

    def step(params, state, x, y):
        grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params, value=jnp.float32(0.5) + jnp.mean(x))
        return optax.apply_updates(params, updates), state

    return step


def params_row():
    return jax.tree.map(jnp.asarray, init_params())


def data(n: int, steps: int):
    return replica_data(n, steps)


def assert_trees_identical(got, want, what: str = "") -> None:
    """Same structure, dtypes, shapes and bits (NaNs equal) on every leaf."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    gl = jax.tree_util.tree_leaves_with_path(got)
    for (path, a), b in zip(gl, jax.tree.leaves(want)):
        a, b = np.asarray(a), np.asarray(b)
        where = f"{what}{jax.tree_util.keystr(path)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert np.array_equal(a, b, equal_nan=True), (where, np.max(np.abs(a.astype(np.float64) - b)))


def host(tree):
    """A tree of global (possibly multi-process) arrays as this process's rows, in NumPy."""

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)
            return np.concatenate([np.asarray(s.data) for s in shards])
        return np.asarray(x)

    return jax.tree.map(one, tree)
