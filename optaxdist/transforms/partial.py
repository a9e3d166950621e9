"""Partial synchronization: Apache SINGA's ``backward_and_partial_update`` (``partial_average``:
after every local step, one partition of the parameters, round-robin, is replaced by its mean over
the replicas), and the partitions of the parameters that it and Streaming DiLoCo's fragments use.

Partitions are static: tuples of leaf indices of the flattened parameter tree.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from optaxdist.accounting import Kind, dtype_label, payload_bytes
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype
from optaxdist.transforms.periodic import SyncInput, check_comm, periodic

Partition = tuple[tuple[int, ...], ...]


def singa_partitions(params: Any, threshold: int = 2_097_152) -> Partition:
    """SINGA's partitions: leaves in backward (reverse) order; a leaf of more than ``threshold``
    elements is a partition of its own, smaller ones are packed until their running size exceeds
    ``threshold`` (the leaf that crosses it closes the partition)."""
    sizes = [int(np.prod(x.shape)) for x in jax.tree.leaves(params)]
    parts, bucket, acc = [], [], 0
    for i in reversed(range(len(sizes))):
        if sizes[i] > threshold:
            parts.append((i,))
            continue
        bucket.append(i)
        acc += sizes[i]
        if acc > threshold:
            parts.append(tuple(bucket))
            bucket, acc = [], 0
    if bucket:
        parts.append(tuple(bucket))
    return tuple(parts)


def balanced_fragments(params: Any, num_fragments: int) -> Partition:
    """``num_fragments`` groups of consecutive leaves with element counts as equal as possible."""
    sizes = np.asarray([int(np.prod(x.shape)) for x in jax.tree.leaves(params)])
    if not 1 <= num_fragments <= len(sizes):
        raise ValueError(f"num_fragments={num_fragments} must be in [1, {len(sizes)}] (the leaves)")
    cum = np.concatenate([[0], np.cumsum(sizes)])
    targets = np.arange(1, num_fragments) * sizes.sum() / num_fragments
    nearest = np.abs(cum[:, None] - targets[None, :]).argmin(0)  # leaf boundary nearest each target
    bounds = [0]
    for j, cut in enumerate(nearest.tolist(), start=1):  # keep every fragment non-empty
        bounds.append(min(max(cut, bounds[-1] + 1), len(sizes) - (num_fragments - j)))
    bounds.append(len(sizes))
    return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(num_fragments))


def _check_partition(partition: Partition, num_leaves: int) -> Partition:
    flat = sorted(i for part in partition for i in part)
    if flat != list(range(num_leaves)) or any(not part for part in partition):
        raise ValueError(
            f"partitions {partition} must be non-empty and cover each of the {num_leaves} leaves once"
        )
    return tuple(tuple(int(i) for i in part) for part in partition)


def resolve_partition(spec, params) -> Partition:
    """The partition ``spec`` (tuples of leaf indices, or a function of ``params`` returning them),
    checked: non-empty groups covering every leaf once."""
    leaves = jax.tree.leaves(params)
    partition = spec(params) if callable(spec) else spec
    return _check_partition(partition, len(leaves))


@configured("partial_average")
def partial_average(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    partitions: Partition | Any = singa_partitions,
    dtype: Any = None,
    warmup_steps: int = 0,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""Local steps; after step :math:`t`, partition :math:`t \bmod K` is replaced by its mean.

    .. math::
        x_i \leftarrow x_i + \mathrm{inner}(g_i); \qquad
        x_{i,P_k} \leftarrow \frac1W \sum_j x_{j,P_k}, \quad k = t \bmod K

    All other parameters, and the inner optimizer's state, stay local (SINGA never synchronizes
    momentum).

    Communication: one all-reduce per step of partition ``t mod K``'s parameters (ledger
    ``all_reduce[partition<k>:<dtype>]``), a branch of ``lax.switch`` on the replicated step: each
    parameter is averaged once every ``K`` steps.

    Args:
      inner: the local optimizer.
      comm: all replicas.
      partitions: a tuple of tuples of leaf indices (of ``jax.tree.leaves(params)``), or a
        function of the parameters returning one (default ``singa_partitions``, SINGA's packing
        by 2,097,152 elements in backward order).
      dtype: wire dtype of the averages (None: the parameters' dtype).
      warmup_steps: synchronous steps (gradients all-reduced, nothing else) before the round-robin
        starts with partition 0.
      check_start: raise on the first step if the replicas' parameters differ (compares a
        fingerprint: 4 bytes per leaf).
      nonfinite: the local step's non-finite policy, ``"skip"`` (default) or ``"ignore"``; see
        ``optaxdist.transforms.periodic.periodic``.

    References:
      Apache SINGA ``DistOpt.backward_and_partial_update``.
    """
    check_comm("comm", comm)
    wire = canonical_comm_dtype(dtype)

    def kind(k: int, leaves) -> Kind:
        return Kind("all_reduce", f"partition{k}:{dtype_label(leaves, wire)}")

    def kinds(params, inner_state):
        leaves = jax.tree.leaves(params)
        parts = resolve_partition(partitions, params)
        return {
            kind(k, [leaves[i] for i in part]): payload_bytes([leaves[i] for i in part], wire)
            for k, part in enumerate(parts)
        }

    def average(part: tuple[int, ...], k: int):
        def sync(x: SyncInput) -> SyncInput:
            values, treedef = jax.tree.flatten(x.local)
            averaged = comm.pmean([values[i] for i in part], dtype=wire)
            for i, a in zip(part, averaged):
                values[i] = a
            p_leaves = jax.tree.leaves(x.params)
            ledger = x.ledger.record(kind(k, [p_leaves[i] for i in part]))
            return x._replace(local=jax.tree.unflatten(treedef, values), ledger=ledger)

        return sync

    return periodic(
        inner,
        comm=comm,
        name="partial_average",
        schedule=lambda s, num_partitions: s % num_partitions + 1,
        syncs=lambda params: [
            average(part, k) for k, part in enumerate(resolve_partition(partitions, params))
        ],
        kinds=kinds,
        warmup_steps=warmup_steps,
        dtype=dtype,
        check_start=check_start,
        nonfinite=nonfinite,
    )
