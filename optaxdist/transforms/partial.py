"""Partial synchronization: Apache SINGA's ``backward_and_partial_update`` (``partial_average``:
after every local step, one partition of the parameters (``optaxdist.partition``), round-robin,
is replaced by its mean over the replicas)."""

from __future__ import annotations

from typing import Any

import jax
import optax

from optaxdist.accounting import Kind, dtype_label, payload_bytes
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype
from optaxdist.partition import Partition, resolve_partition, singa_partitions
from optaxdist.transforms._checks import check_comm
from optaxdist.transforms.periodic import SyncInput, periodic


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
    exact_sync: bool = True,
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
      warmup_steps, check_start, nonfinite, exact_sync: the engine's options (``periodic``); the round-robin
        starts with partition 0 after the warm-up.

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
            return x._replace(local=jax.tree.unflatten(treedef, values), ledger=ledger, agreed=part)

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
        exact_sync=exact_sync,
    )
