"""Outer optimizers on periodically averaged replicas: DiLoCo and SlowMo (one engine).

Every ``period`` steps the replicas' displacement from the shared *anchor* ``x₀`` (the parameters
at the last sync) is averaged into a pseudo-gradient ``Δ = x₀ − mean_i(x_i)``; an outer optax
optimizer turns it into a step on ``x₀``, and every replica restarts from the new ``x₀``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from optaxdist.accounting import CommLedger, kind_name, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.transforms._checks import check_float_leaves, check_nonfinite, local_step
from optaxdist.transforms._start import check_identical_start, start_kinds
from optaxdist.transforms.allreduce import allreduce


class OuterSyncState(NamedTuple):
    """State of ``diloco`` / ``slowmo``.

    Attributes:
      outer_step: inner steps so far (int32, replicated).
      inner_state: the inner optimizer's state (per replica).
      anchor_params: ``x₀``, the parameters at the last sync (replicated). When sharded, a flat
        block of ``ceil(P / num_shards)`` elements per replica (replica ``i`` holds block ``i``).
      outer_state: the outer optimizer's state (replicated; a block per replica when sharded).
      reducer_state: the pseudo-gradient reducer's state (e.g. an error-feedback residual, per
        replica); empty when sharded.
      outer_ledger: what the sharded sync sent (reduce-scatter and all-gather; replicated).
    """

    outer_step: jax.Array
    inner_state: optax.OptState
    anchor_params: Any
    outer_state: optax.OptState
    reducer_state: optax.OptState
    outer_ledger: CommLedger


@configured("outer_sync")
def outer_sync(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int,
    reducer: optax.GradientTransformation | None = None,
    num_shards: int | None = None,
    anchor_after_first_step: bool = False,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""The engine behind ``diloco`` and ``slowmo``; see ``diloco`` for the math.

    Args:
      inner: the local optimizer.
      outer: the outer optimizer, applied to the averaged pseudo-gradient every ``period`` steps.
        Its ``update`` receives the extra argument ``inner_step`` (the 0-based step of the sync).
      comm: all replicas.
      period: inner steps between syncs (≥ 1).
      reducer: how the per-replica pseudo-gradients ``x₀ − x_i`` are averaged: any gradient
        transformation that averages over ``comm`` (default ``allreduce(comm=comm)``; e.g.
        ``compressed_allreduce(compress.top_k(...), comm=comm)`` for compressed pseudo-gradients
        with error feedback).
      num_shards: memory-efficient mode: shard ``x₀`` and the outer state over the ``num_shards``
        (= ``comm.size``) replicas; a sync is a reduce-scatter of the parameters, the outer update
        on this replica's block, and an all-gather of the new anchor. Same numbers for element-wise
        outer optimizers (SGD, Nesterov, Adam), ``1/W`` of the outer memory. Incompatible with a
        custom ``reducer``.
      anchor_after_first_step: take ``x₀`` *after* the first local step (fairscale's behaviour:
        the first sync then covers ``period − 1`` steps) instead of before training. fairscale
        takes each process's own parameters, so its replicas' anchors differ; here it is their
        mean (one extra all-reduce at step 0, ledger ``anchor_average[float32]``).
      check_start: on the first step, raise ``ValueError`` if the replicas' parameters differ
        (fingerprints compared: 4 bytes per leaf and a 4-byte vote, ledger
        ``broadcast[start check]``).
      nonfinite: a local step whose update is not finite is skipped on this replica only
        (``"skip"``, the default: zero update, inner state kept, nothing sent, so non-finite
        gradients never reach any replica's state) or applied as it is (``"ignore"``, no cost).
    """
    if not isinstance(period, int) or period < 1:
        raise ValueError(f"period={period!r} must be an int ≥ 1")
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an optaxdist Communicator, got {type(comm).__name__}")
    if num_shards is not None and (not isinstance(num_shards, int) or num_shards < 1):
        raise ValueError(f"num_shards={num_shards!r} must be None or an int ≥ 1 (the group size)")
    if num_shards is not None and reducer is not None:
        raise ValueError("num_shards (memory-efficient mode) and a custom reducer can't be combined")
    check_nonfinite(nonfinite)
    inner = optax.with_extra_args_support(inner)
    outer = optax.with_extra_args_support(outer)
    reducer = optax.with_extra_args_support(reducer or allreduce(comm=comm))
    sharded = num_shards is not None

    def anchor_kind(params) -> dict[str, int]:
        kinds = (
            {kind_name("anchor_average", params): payload_bytes(params)} if anchor_after_first_step else {}
        )
        return kinds | start_kinds(check_start, params)

    def block_size(params) -> tuple[int, int]:
        size = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
        block = -(-size // num_shards)
        return size, block

    def init_fn(params):
        check_float_leaves(params, "diloco/slowmo")
        inner_state = per_replica(inner.init(params), comm)
        if sharded:
            _, block = block_size(params)
            dtype = jnp.result_type(*jax.tree.leaves(params))
            # Filled from the parameters on the first update, where this replica's index is known.
            anchor = jnp.zeros((block,), dtype)
            ledger = CommLedger.create(
                {
                    f"reduce_scatter[{jnp.dtype(dtype).name}]": block
                    * num_shards
                    * jnp.dtype(dtype).itemsize,
                    f"all_gather[{jnp.dtype(dtype).name}]": block * jnp.dtype(dtype).itemsize,
                    **anchor_kind(params),
                }
            )
            return OuterSyncState(
                outer_step=jnp.zeros((), jnp.int32),
                inner_state=inner_state,
                anchor_params=per_replica(anchor, comm),
                outer_state=per_replica(outer.init(anchor), comm),
                reducer_state=(),
                outer_ledger=ledger,
            )
        # a copy, not an alias: callers may donate params and state to the same jitted step
        anchor = jax.tree.map(lambda p: jnp.array(p, copy=True), params)
        return OuterSyncState(
            outer_step=jnp.zeros((), jnp.int32),
            inner_state=inner_state,
            anchor_params=per_replica(anchor, comm),
            outer_state=per_replica(outer.init(anchor), comm),
            reducer_state=per_replica(reducer.init(params), comm),
            outer_ledger=CommLedger.create(anchor_kind(params)),
        )

    def my_block(flat, block):
        padded = jnp.pad(flat, (0, block * num_shards - flat.shape[0]))
        return jax.lax.dynamic_slice(padded, (comm.index() * block,), (block,))

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("diloco/slowmo need params: call update(updates, state, params)")
        if sharded and comm.size != num_shards:
            raise ValueError(f"num_shards={num_shards} must equal the group size {comm.size}")
        t = comm.uniform(state.outer_step)  # keeps the sync a branch under simulate

        def local(g, inner_s):
            return local_step(inner, g, inner_s, params, nonfinite=nonfinite, **extra)

        anchor = state.anchor_params
        ledger = check_identical_start(check_start, params, t, state.outer_ledger, comm)
        if anchor_after_first_step:
            # fairscale's quirk, made consistent: x0 is the replicas' mean after the first step
            def first(operand):
                anchor, ledger = operand
                mean = comm.pmean(optax.apply_updates(params, local(updates, state.inner_state)[0]))
                if sharded:
                    anchor = my_block(ravel_pytree(mean)[0], block_size(params)[1])
                else:
                    anchor = mean
                return per_replica((anchor, ledger.record(kind_name("anchor_average", params))), comm)

            anchor, ledger = jax.lax.cond(t == 0, first, lambda o: per_replica(o, comm), (anchor, ledger))
        elif sharded:  # the anchor block is filled at step 0, where comm.index() is known
            anchor = jax.lax.cond(
                t == 0,
                lambda a: per_replica(my_block(ravel_pytree(params)[0], block_size(params)[1]), comm),
                lambda a: per_replica(a, comm),
                anchor,
            )

        # Both branches take the local step themselves, so that on local steps the inner update
        # is computed straight into the outputs instead of being copied through the cond.
        def sync(operand):
            g, inner_s, anchor, outer_state, reducer_state, ledger = operand
            u, inner_s = local(g, inner_s)
            local_params = optax.apply_updates(params, u)
            if sharded:
                flat_local, unravel = ravel_pytree(local_params)
                size, block = block_size(params)
                padded = jnp.pad(flat_local, (0, block * num_shards - size))
                mean_block = comm.psum_scatter(padded) / jnp.asarray(num_shards, padded.dtype)
                delta = anchor - mean_block
                step, outer_state = outer.update(delta, outer_state, anchor, inner_step=t)
                anchor = optax.apply_updates(anchor, step)
                new_params = unravel(comm.all_gather(anchor).reshape(-1)[:size])
                dt = jnp.dtype(padded.dtype).name
                ledger = ledger.record(f"reduce_scatter[{dt}]").record(f"all_gather[{dt}]")
            else:
                pseudo = jax.tree.map(lambda a, x: a - x, anchor, local_params)
                delta, reducer_state = reducer.update(pseudo, reducer_state, anchor)
                step, outer_state = outer.update(delta, outer_state, anchor, inner_step=t)
                anchor = optax.apply_updates(anchor, step)
                new_params = anchor
            out = jax.tree.map(lambda n, p: (n - p).astype(p.dtype), new_params, params)
            return per_replica((out, inner_s, anchor, outer_state, reducer_state, ledger), comm)

        def no_sync(operand):
            g, inner_s, *rest = operand
            return per_replica((*local(g, inner_s), *rest), comm)

        out, inner_state, anchor, outer_state, reducer_state, ledger = jax.lax.cond(
            (t + 1) % period == 0,
            sync,
            no_sync,
            (updates, state.inner_state, anchor, state.outer_state, state.reducer_state, ledger),
        )
        return out, OuterSyncState(
            outer_step=optax.safe_increment(t),
            inner_state=inner_state,
            anchor_params=anchor,
            outer_state=outer_state,
            reducer_state=reducer_state,
            outer_ledger=ledger,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def diloco_outer_optimizer(
    learning_rate: float = 0.7, momentum: float = 0.9, nesterov: bool = True
) -> optax.GradientTransformation:
    """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
    return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)


@configured("diloco")
def diloco(
    inner: optax.GradientTransformation,
    outer: optax.GradientTransformation | None = None,
    *,
    comm: Communicator,
    period: int,
    reducer: optax.GradientTransformation | None = None,
    num_shards: int | None = None,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""DiLoCo: ``period`` local steps of ``inner``, then an outer step on the averaged displacement.

    With :math:`x_0` the anchor (parameters at the last sync, initially the parameters passed to
    ``init``) and :math:`x_i` replica :math:`i` after its local steps, on steps :math:`t` with
    :math:`(t+1) \bmod H = 0`:

    .. math::
        \Delta = \frac1W \sum_i (x_0 - x_i), \qquad
        x_0 \leftarrow x_0 + \mathrm{outer}(\Delta), \qquad x_i \leftarrow x_0 .

    ``outer = optax.sgd(1.0)`` gives local SGD (parameter averaging every ``H`` steps).

    Communication: on sync steps the ``reducer``'s collective on the pseudo-gradient — by default
    one all-reduce of every parameter element (ledger ``all_reduce[...]``), i.e. ``P/H`` per step;
    with ``reducer=compressed_allreduce(...)`` whatever that compressor sends, with error feedback
    kept per replica. With ``num_shards``: one reduce-scatter of ``P`` and one all-gather of
    ``P/W`` per sync. Nothing on other steps (``lax.cond`` on the replicated step counter).

    Args:
      inner: the local optimizer (DiLoCo: AdamW).
      outer: the outer optimizer (default ``diloco_outer_optimizer()``: Nesterov SGD, lr 0.7,
        momentum 0.9).
      comm: all replicas.
      period: H, local steps between syncs (DiLoCo: 500).
      reducer: averages the pseudo-gradients (default ``allreduce(comm=comm)``).
      num_shards: shard the anchor and outer state over the replicas (``= comm.size``).
      check_start: raise on the first step if the replicas' parameters differ.
      nonfinite: a local step whose update is not finite is skipped on this replica only
        (``"skip"``, the default: zero update, inner state kept, nothing sent, so non-finite
        gradients never reach any replica's state) or applied as it is (``"ignore"``, no cost).

    Example:
      >>> tx = diloco(optax.adamw(4e-4), comm=comm, period=500)  # doctest: +SKIP

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
      arXiv:2311.08105.
    """
    return outer_sync(
        inner,
        outer if outer is not None else diloco_outer_optimizer(),
        comm=comm,
        period=period,
        reducer=reducer,
        num_shards=num_shards,
        check_start=check_start,
        nonfinite=nonfinite,
    )


class SlowMoOuterState(NamedTuple):
    """State of the SlowMo outer step: the slow momentum buffer ``u``."""

    slow_momentum: optax.Updates


def slowmo_outer_optimizer(
    learning_rate: optax.ScalarOrSchedule, *, momentum: float = 0.5, slow_lr: float = 1.0
) -> optax.GradientTransformationExtraArgs:
    r"""fairscale's slow-momentum step on the pseudo-gradient :math:`\Delta = x_0 - \bar x`:

    .. math:: u \leftarrow \beta u + \Delta / \eta_t, \qquad x_0 \leftarrow x_0 - \alpha\,\eta_t\, u

    with :math:`\eta_t` the inner learning rate at the sync step (``inner_step`` extra argument).
    """

    def init_fn(params):
        return SlowMoOuterState(jax.tree.map(jnp.zeros_like, params))

    def update_fn(delta, state, params=None, *, inner_step=0, **extra):
        del params, extra
        lr = learning_rate(inner_step) if callable(learning_rate) else learning_rate
        u = jax.tree.map(lambda b, d: momentum * b + d / jnp.asarray(lr, d.dtype), state.slow_momentum, delta)
        step = jax.tree.map(lambda b: -jnp.asarray(slow_lr * lr, b.dtype) * b, u)
        return step, SlowMoOuterState(u)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@configured("slowmo")
def slowmo(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    period: int,
    learning_rate: optax.ScalarOrSchedule,
    momentum: float = 0.5,
    slow_lr: float = 1.0,
    memory_efficient: bool = False,
    anchor_after_first_step: bool = False,
    num_shards: int | None = None,
    check_start: bool = True,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""SlowMo (fairscale ``SlowMoDistributedDataParallel`` with LocalSGD base): local steps, and
    every ``period`` (τ) steps average the parameters and take a slow-momentum step.

    .. math::
        \bar x = \frac1W\sum_i x_i, \quad u \leftarrow \beta u + \frac{x_0 - \bar x}{\eta_t}, \quad
        x_0 \leftarrow x_0 - \alpha\,\eta_t\,u, \quad x_i \leftarrow x_0

    with :math:`\eta_t` the inner optimizer's current learning rate (pass the same float or
    schedule as ``learning_rate``). β = 0, α = 1 is local SGD. For fairscale's extra LocalSGD
    averaging every ``H`` steps between slow steps, use ``inner=local_sgd(..., period=H)``.

    Communication: one all-reduce of the parameters every τ steps (``all_reduce[...]``); with
    ``memory_efficient`` a reduce-scatter of ``P`` and an all-gather of ``P/W`` instead, and ``x₀``
    and ``u`` are sharded over the replicas (fairscale's ZeRO-1-like layout, same numbers).

    Args:
      inner: the local optimizer.
      comm: all replicas.
      period: τ (fairscale default 48).
      learning_rate: the inner optimizer's learning rate (float or the same schedule).
      momentum: β (fairscale default 0.5).
      slow_lr: α (fairscale default 1.0).
      memory_efficient: shard ``x₀`` and ``u`` (needs ``num_shards=comm.size``).
      anchor_after_first_step: fairscale's quirk: ``x₀`` taken after the first local step (the
        first slow step then covers τ−1 steps), as the replicas' mean (fairscale: each process's
        own). Default: the parameters before training.
      num_shards: the group size, required with ``memory_efficient`` (static).
      check_start: raise on the first step if the replicas' parameters differ.
      nonfinite: a local step whose update is not finite is skipped on this replica only
        (``"skip"``, the default: zero update, inner state kept, nothing sent, so non-finite
        gradients never reach any replica's state) or applied as it is (``"ignore"``, no cost).

    References:
      Wang, Tantia, Ballas, Rabbat, "SlowMo: Improving Communication-Efficient Distributed SGD with
      Slow Momentum", ICLR 2020. fairscale ``SlowMoDistributedDataParallel``.
    """
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
    if not callable(learning_rate) and not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r} must be > 0 (SlowMo divides by it) or a schedule")
    if not slow_lr > 0:
        raise ValueError(f"slow_lr={slow_lr!r} must be > 0")
    if memory_efficient and num_shards is None:
        raise ValueError("memory_efficient=True needs num_shards=<number of replicas>")
    if not memory_efficient and num_shards is not None:
        raise ValueError("num_shards applies only with memory_efficient=True")
    return outer_sync(
        inner,
        slowmo_outer_optimizer(learning_rate, momentum=momentum, slow_lr=slow_lr),
        comm=comm,
        period=period,
        num_shards=num_shards,
        anchor_after_first_step=anchor_after_first_step,
        check_start=check_start,
        nonfinite=nonfinite,
    )
