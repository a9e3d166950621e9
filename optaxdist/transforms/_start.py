"""Checking that replicas start identical: shared by the transforms that average parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist.accounting import CommLedger, per_replica
from optaxdist.comm.base import Communicator

CHECK_KIND = "broadcast[start check]"


def fingerprint(tree: Any) -> jax.Array:
    """One uint32 per leaf: ``Σ_k bits_k · (2k + 1) mod 2³²`` over the leaf's bit patterns.

    Any single differing element changes it (odd multipliers are invertible mod 2³²), so equal
    fingerprints on every replica mean identical parameters up to a negligible chance.
    """
    out = []
    for leaf in jax.tree.leaves(tree):
        x = jnp.ravel(jnp.asarray(leaf))
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
        bits = jax.lax.bitcast_convert_type(x, width) if x.dtype.itemsize < 8 else x
        weights = (2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1).reshape(bits.shape[:1])
        out.append(jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def start_kinds(check_start: bool, params: Any) -> dict[str, int]:
    """Ledger kind of the one-time check: a broadcast of one uint32 per leaf, and a 4-byte vote."""
    return {CHECK_KIND: 4 * len(jax.tree.leaves(params)) + 4} if check_start else {}


def _raise_if_different(ok) -> None:
    if not np.all(ok):
        raise ValueError(
            "replicas do not start from identical parameters: make them identical first with "
            "optaxdist.broadcast_from_root (inside the step) or by initialising every replica "
            "from the same seed"
        )


def check_identical_start(
    check_start: bool, params: Any, step: jax.Array, ledger: CommLedger, comm: Communicator
) -> CommLedger:
    """On step 0, raise ``ValueError`` on every replica together if the replicas' parameters
    differ: their fingerprints are compared with replica 0's (a broadcast of one uint32 per leaf
    and one int32 agreement, at step 0 only)."""
    if not check_start:
        return ledger

    def first(led):
        mine = fingerprint(params)
        same = comm.agree(jnp.all(mine == comm.broadcast(mine, 0)), op="all")
        # Under vmap with a batched step counter both branches run: re-test the step here.
        jax.debug.callback(_raise_if_different, same | (step != 0))
        return per_replica(led.record(CHECK_KIND), comm)

    return jax.lax.cond(step == 0, first, lambda led: per_replica(led, comm), ledger)
