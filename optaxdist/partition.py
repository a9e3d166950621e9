"""Partitions of the parameters: static groups of leaf indices (of ``jax.tree.leaves(params)``),
like topologies static data. ``partial_average`` averages one partition per step, Streaming
DiLoCo syncs one fragment at a time."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

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
