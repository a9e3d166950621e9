"""Local SGD: local steps, parameter averaging every ``period`` steps (fairscale LocalSGD, post-local
SGD, PyTorch's PeriodicModelAverager and HierarchicalModelAverager)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import Kind, kind_name, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype
from optaxdist.transforms._checks import check_comm
from optaxdist.transforms.periodic import Sync, SyncInput, every_leaf, periodic, periodic_states

NO_SYNC, LOCAL_SYNC, GLOBAL_SYNC = 0, 1, 2


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class ParamAverage:
    """``local_sgd``'s synchronization state: static, no arrays. ``node_level`` tells
    ``sync_model_state`` that some syncs average within the node only (``PeriodicState.last_sync``:
    1 within the node, 2 over all replicas)."""

    node_level: bool


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating)


def _average_floats(tree, comm: Communicator, dtype):
    """``comm.pmean`` of the floating-point leaves of ``tree``; other leaves (counters) unchanged."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [x for x in leaves if _is_float(x)]
    averaged = iter(comm.pmean(floats, dtype=dtype))
    return jax.tree.unflatten(treedef, [next(averaged) if _is_float(x) else x for x in leaves])


def _float_leaves(tree):
    return [x for x in jax.tree.leaves(tree) if _is_float(x)]


@configured("local_sgd")
def local_sgd(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int,
    warmup_steps: int = 0,
    average_inner_state: bool = False,
    local_comm: Communicator | None = None,
    local_period: int | None = None,
    dtype: Any = None,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""Take local steps with ``inner``; every ``period`` steps replace the parameters by their mean.

    With :math:`t` the 0-based step, :math:`T_w` = ``warmup_steps`` and :math:`x_i` replica
    :math:`i`'s parameters:

    * :math:`t < T_w` (post-local SGD warm-up): :math:`g \leftarrow \frac1W\sum_i g_i` before
      ``inner`` (synchronous SGD; replicas stay identical).
    * otherwise :math:`x_i \leftarrow x_i + \mathrm{inner}(g_i)`, then, with :math:`s = t - T_w + 1`,
      if :math:`s \bmod p = 0`: :math:`x_i \leftarrow \frac1W \sum_j x_j` over ``comm``; else, with
      a node level, if :math:`s \bmod p_\ell = 0`: the mean over ``local_comm`` only.

    ``period=1`` is synchronous SGD by parameter averaging. The returned update is
    ``target − params``. With ``average_inner_state`` the floating-point leaves of ``inner``'s
    state (momentum, Adam moments) are averaged at the same syncs. Non-parameter model state
    (BatchNorm statistics) lives outside the optimizer: average it with ``sync_model_state``.

    Communication (``P`` = parameter bytes in ``dtype``):
      on each global sync one all-reduce of ``P`` over ``comm`` (ledger ``param_average[...]``);
      on each node sync one all-reduce of ``P`` over ``local_comm`` (``local:param_average[...]``);
      during warm-up one all-reduce of the gradients per step (``all_reduce[...]``); with
      ``average_inner_state`` one all-reduce of the inner state's float leaves per sync
      (``inner_state_average[...]``; ``local:inner_state_average[...]`` at a node sync). Per step
      on average: ``P / period`` over ``comm`` (plus ``P / local_period`` over ``local_comm``, plus
      the inner state per sync). Syncs run inside ``lax.switch`` on the replicated step counter:
      nothing is sent on other steps.

    Args:
      inner: the local optimizer.
        During the warm-up the gradients are all-reduced first, so every replica skips.
      comm: all replicas.
      period: steps between global averages (≥ 1).
      warmup_steps: exact gradient all-reduce steps before local SGD starts (post-local SGD).
      average_inner_state: also average the inner optimizer's float state at a sync.
      local_comm: the node-local group for hierarchical averaging (``Hierarchy.local``).
      local_period: steps between node-local averages; ``period`` must be a multiple of it.
      dtype: wire dtype of the averages (None: the parameters' dtype).
      check_start, nonfinite, exact_sync: the engine's options (``periodic``): raise on the first
        step if the replicas' parameters differ (make them identical with
        ``broadcast_from_root``); the local step's non-finite policy; keep a copy of the averaged
        parameters so that ``optaxdist.apply_updates`` leaves the replicas bit-identical after
        each average.

    Example:
      >>> tx = local_sgd(optax.sgd(0.1, momentum=0.9), comm=comm, period=8)

    References:
      Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", ICLR 2020. Wang et al.,
      "SlowMo", ICLR 2020 (fairscale LocalSGD). PyTorch ``PeriodicModelAverager``,
      ``HierarchicalModelAverager``.
    """
    period = check_int("period", period, 1)
    check_bools(average_inner_state=average_inner_state)
    if (local_comm is None) != (local_period is None):
        raise ValueError("give both local_comm and local_period for hierarchical averaging, or neither")
    if local_period is not None:
        local_period = check_int("local_period", local_period, 1)
    if local_period is not None and period % local_period:
        raise ValueError(f"local_period={local_period!r} must divide period={period}")
    check_comm("comm", comm)
    if local_comm is not None:
        check_comm("local_comm", local_comm)
    wire = canonical_comm_dtype(dtype)

    scopes = ("world", "local") if local_comm is not None else ("world",)

    def average_kind(tree, label: str, scope: str) -> Kind:
        return kind_name("all_reduce", tree, wire, label=label, scope=scope)

    def kinds(params, inner_state):
        floats = _float_leaves(inner_state) if average_inner_state else []
        out = {}
        for scope in scopes:
            out[average_kind(params, "param_average", scope)] = payload_bytes(params, wire)
            if floats:
                out[average_kind(floats, "inner_state_average", scope)] = payload_bytes(floats, wire)
        return out

    def average_over(group: Communicator | None, scope: str) -> Sync:
        def sync(x: SyncInput) -> SyncInput:
            if group is None:  # no node level: never scheduled
                return x
            ledger = x.ledger.record(average_kind(x.params, "param_average", scope))
            inner_state = x.inner_state
            if average_inner_state and _float_leaves(inner_state):
                inner_state = _average_floats(inner_state, group, wire)
                ledger = ledger.record(average_kind(_float_leaves(inner_state), "inner_state_average", scope))
            return x._replace(
                local=group.pmean(x.local, dtype=wire),
                inner_state=inner_state,
                ledger=ledger,
                agreed=every_leaf(x.local),
            )

        return sync

    def schedule(s, num_syncs):
        level = jnp.where((s + 1) % period == 0, GLOBAL_SYNC, NO_SYNC)
        if local_period is not None:
            level = jnp.where((level == NO_SYNC) & ((s + 1) % local_period == 0), LOCAL_SYNC, level)
        return level

    return periodic(
        inner,
        comm=comm,
        name="local_sgd",
        schedule=schedule,
        syncs=[average_over(local_comm, "local"), average_over(comm, "world")],
        kinds=kinds,
        init_sync=lambda params: ParamAverage(node_level=local_comm is not None),
        warmup_steps=warmup_steps,
        dtype=dtype,
        check_start=check_start,
        nonfinite=nonfinite,
        exact_sync=exact_sync,
        averages_inner_state=average_inner_state,
    )


@configured("average_params")
def average_params(
    *, comm: Communicator, dtype: Any = None, exact_sync: bool = True
) -> optax.GradientTransformationExtraArgs:
    r"""Average the parameters after every local step (mlbench ``agg_grad=False``).

    Place it *after* the local optimizer. With :math:`u_i` the local update of replica :math:`i`:

    .. math:: x^{+} = \frac{1}{W}\sum_i (x_i + u_i), \qquad \text{returned update } = x^{+} - x_i.

    Optimizer state (momentum, Adam moments) stays local to each replica, as in mlbench. It is
    ``local_sgd(optax.identity(), comm=comm, period=1, dtype=dtype)`` without the start check (the
    first average makes the replicas identical) and without a non-finite policy (state
    ``PeriodicState``). With identical starting parameters and plain SGD this equals gradient
    all-reduce.

    Communication: one all-reduce per step of every parameter element in ``dtype`` (the
    parameters' dtype when None), ledger ``param_average[<dtype>]``.

    Example:
      >>> tx = optax.chain(optax.sgd(0.1), optaxdist.average_params(comm=comm))

    References:
      mlbench ``GenericCentralizedOptimizer(agg_grad=False)``.
    """
    tx = local_sgd(
        optax.identity(),
        comm=comm,
        period=1,
        dtype=dtype,
        check_start=False,
        nonfinite="ignore",
        exact_sync=exact_sync,
    )

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("average_params needs params: call update(updates, state, params)")
        return tx.update(updates, state, params, **extra)

    return tx._replace(update=update_fn)


def sync_model_state(
    model_state: Any,
    opt_state: Any,
    *,
    comm: Communicator,
    local_comm: Communicator | None = None,
) -> Any:
    """Average non-parameter model state (BatchNorm statistics) on the steps where ``local_sgd``
    just averaged the parameters: over ``comm`` after a global sync, over ``local_comm`` after a
    node-local one; unchanged otherwise. Call it after ``update`` with the new ``opt_state``.

    Communication: one all-reduce of the float leaves of ``model_state`` on sync steps only. This
    function has no state of its own, so these bytes are not in the optimizer's ledger.
    """
    states = [s for s in periodic_states(opt_state) if isinstance(s.sync_state, ParamAverage)]
    if len(states) != 1:
        raise ValueError(f"found {len(states)} local_sgd states in opt_state; expected one")
    if states[0].sync_state.node_level and local_comm is None:
        raise ValueError(
            "local_sgd averages within the node (local_comm=...): pass the same local_comm to "
            "sync_model_state, or the node-level syncs would leave model_state unaveraged"
        )
    level = states[0].last_sync
    groups = [None, local_comm, comm]
    branches = [
        lambda x, g=g: per_replica(x if g is None else _average_floats(x, g, None), comm) for g in groups
    ]
    return jax.lax.switch(level, branches, model_state)
