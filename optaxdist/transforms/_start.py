"""Checking that replicas start identical: shared by the transforms that average parameters."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from optaxdist._compat import manual_axes, shard_map
from optaxdist.accounting import CommLedger, Kind, payload_bytes, per_replica
from optaxdist.comm.base import Communicator

CHECK_KIND = Kind("broadcast", "start check")


def _bit_words(x: jax.Array) -> jax.Array:
    """The bit patterns of ``x`` as unsigned words, in ``x``'s shape (8-byte values and complex
    numbers get one more trailing dimension: their two words, or real and imaginary parts)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([x.real, x.imag], axis=-1)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, width)


def _row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """Each element's position in the flattened array, as uint32 of ``shape``: computed per
    element, so a leaf split over model axes is never gathered to be flattened."""
    index = jnp.zeros(shape, jnp.uint32)
    for d, n in enumerate(shape):
        index = index * jnp.uint32(n) + jax.lax.broadcasted_iota(jnp.uint32, shape, d)
    return index


def fingerprint(tree: Any) -> jax.Array:
    """One uint32 per leaf: ``Σ_k bits_k · (2k + 1) mod 2³²`` over the leaf's bit patterns in
    row-major order (8-byte values contribute both of their 32-bit words).

    Any single differing element changes it (odd multipliers are invertible mod 2³²), so equal
    fingerprints on every replica mean identical parameters up to a negligible chance.
    """
    out = []
    for leaf in jax.tree.leaves(tree):
        bits = _bit_words(leaf).astype(jnp.uint32)
        weights = 2 * _row_major_index(bits.shape) + 1
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


def _host_verdict(same: jax.Array) -> jax.Array:
    """``_verdict`` on the host as a ``pure_callback``: a zero, or ``ValueError``.

    JAX runs no host callback where some mesh axes are left to the compiler (a ``shard_map``
    manual over the replica axes only, the model axes automatic): there the callback runs inside
    a nested ``shard_map`` that makes the remaining axes manual too. The verdict is one scalar,
    identical on every device (``comm.agree``), so it enters and leaves that map unsplit (``P()``).
    """

    def callback(ok):
        return jax.pure_callback(_verdict, jax.ShapeDtypeStruct((), jnp.int32), ok, vmap_method="sequential")

    manual = set(manual_axes())
    auto = tuple(a for a in jax.sharding.get_abstract_mesh().axis_names if a not in manual)
    if not manual or not auto:  # vmap, MPI, or a shard_map manual over every axis
        return callback(same)
    return shard_map(callback, in_specs=P(), out_specs=P(), axis_names=set(auto), check_vma=False)(same)


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

    def first(led):
        mine = fingerprint(params)
        same = comm.agree(jnp.all(mine == comm.broadcast(mine, 0)), op="all")
        return per_replica(led.record(CHECK_KIND, 1 + _host_verdict(same)), comm)

    return jax.lax.cond(comm.uniform(step) == 0, first, lambda led: per_replica(led, comm), ledger)
