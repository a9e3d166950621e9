"""Checking that replicas start identical: shared by the transforms that average parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist._compat import manual_axes
from optaxdist.accounting import CommLedger, Kind, payload_bytes, per_replica
from optaxdist.comm.base import Communicator

CHECK_KIND = Kind("broadcast", "start check")


def _bit_words(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as a flat vector of unsigned words (8-byte values: two uint32)."""
    x = jnp.ravel(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1).ravel()
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width).ravel()


def fingerprint(tree: Any) -> jax.Array:
    """One uint32 per leaf: ``Σ_k bits_k · (2k + 1) mod 2³²`` over the leaf's bit patterns
    (8-byte values contribute both of their 32-bit words).

    Any single differing element changes it (odd multipliers are invertible mod 2³²), so equal
    fingerprints on every replica mean identical parameters up to a negligible chance.
    """
    out = []
    for leaf in jax.tree.leaves(tree):
        bits = _bit_words(jnp.asarray(leaf)).astype(jnp.uint32)
        weights = 2 * jnp.arange(bits.size, dtype=jnp.uint32) + 1
        out.append(jnp.sum(bits * weights, dtype=jnp.uint32))
    return jnp.stack(out) if out else jnp.zeros((0,), jnp.uint32)


def start_kinds(check_start: bool, params: Any) -> dict[Kind, int]:
    """Ledger kind of the one-time check: a broadcast of one uint32 per leaf, and a 4-byte vote."""
    fingerprints = jax.ShapeDtypeStruct((len(jax.tree.leaves(params)),), jnp.uint32)
    vote = jax.ShapeDtypeStruct((), jnp.int32)
    return {CHECK_KIND: payload_bytes([fingerprints, vote])} if check_start else {}


def _verdict(same) -> np.ndarray:
    # Runs on the host: NumPy only. Computing with JAX here (jnp, or np.all on the jax.Array,
    # which dispatches its .all method) deadlocks against the main thread's next dispatch.
    if not np.asarray(same).all():
        raise ValueError(
            "replicas do not start from identical parameters: make them identical first with "
            "optaxdist.broadcast_from_root (inside the step) or by initialising every replica "
            "from the same seed"
        )
    return np.zeros((), np.int32)


def check_identical_start(
    check_start: bool, params: Any, step: jax.Array, ledger: CommLedger, comm: Communicator
) -> CommLedger:
    """On step 0, raise ``ValueError`` on every replica together if the replicas' parameters
    differ: their fingerprints are compared with replica 0's (a broadcast of one uint32 per leaf
    and one int32 agreement, at step 0 only).

    The check sits in a ``lax.cond`` on the replica-uniform step (``comm.uniform``), so on every
    harness, ``simulate`` included, later steps run neither the comparison nor the host callback.
    The callback is a ``pure_callback`` whose (zero) result is counted into the ledger: it carries
    no side effect, so a step keeps JAX's fast dispatch path (a ``debug.callback`` anywhere in the
    program, even in a branch that never runs, costs about a millisecond per call).
    """
    if not check_start:
        return ledger
    mesh = jax.sharding.get_abstract_mesh()
    if set(manual_axes()) and set(manual_axes()) != set(mesh.axis_names):
        raise ValueError(
            "check_start=True cannot run inside a shard_map that leaves mesh axes "
            f"{sorted(set(mesh.axis_names) - set(manual_axes()))} to the compiler (JAX runs no host "
            "callback under partial automatic sharding): start the replicas from identical "
            "parameters (optaxdist.replicate, or broadcast_from_root in a first step) and pass "
            "check_start=False"
        )

    def first(led):
        mine = fingerprint(params)
        same = comm.agree(jnp.all(mine == comm.broadcast(mine, 0)), op="all")
        zero = jax.pure_callback(
            _verdict, jax.ShapeDtypeStruct((), jnp.int32), same, vmap_method="sequential"
        )
        return per_replica(led.record(CHECK_KIND, 1 + zero), comm)

    return jax.lax.cond(comm.uniform(step) == 0, first, lambda led: per_replica(led, comm), ledger)
