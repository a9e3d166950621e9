"""DASO: Distributed Asynchronous and Selective Optimization (Heat ``heat.optim.DASO``).

Two levels of replicas: ``G`` replicas per node (fast links) and ``N`` nodes (slow links). Inside a
node the gradients are averaged on some steps; across nodes the *parameters* are averaged every
``global_skip`` steps by one cross-node group at a time, and the result is merged ``B`` steps later
with a weight that favours the receiver's newer parameters. An epoch-level state machine (warm-up,
cycling with a plateau detector on the training loss, cool-down) chooses how often to sync.

Everything Heat keeps on the host lives here in the optimizer state: the user calls ``update``
once per batch, passing the batch loss as ``value=``. All collectives sit inside ``lax.cond`` /
``lax.switch`` on replicated counters.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist.accounting import CommLedger, kind_name, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype
from optaxdist.transforms._checks import check_nonfinite, local_step

NO_GROUP = -1
FIRST_CYCLES = ("max_global_skips", "heat")
MERGE_WEIGHTS = ("actual", "heat")
HEAT_FIRST_CYCLE = (4, 1, 1)

LOSS_LOCAL_KIND = "local:loss_all_reduce[float32]"
LOSS_GLOBAL_KIND = "global:loss_all_reduce[float32]"
AGREE_LOCAL_KIND = "local:agree[int32]"
AGREE_GLOBAL_KIND = "global:agree[int32]"


class DasoEvents(NamedTuple):
    """What the last ``update`` did (replicated int32/bool scalars; ``-1`` = did not happen).

    Attributes:
      local_grad_sync: the step's gradient was averaged over the node (``local_comm``).
      sent_group: local index ``k`` whose cross-node group ``C_k`` sent its parameters.
      sent_wait: the delay ``B`` stored with that send (Heat's clamped ``batches_to_wait``).
      sent_low_precision: the send used ``downcast`` (else float32).
      merged_group: local index whose pending send was received and merged.
      merged_wait: the ``B`` stored with the merged send.
      merged_delay: batches actually elapsed since the merged send.
      merge_broadcast_root: local index broadcast within the node after the merge (or, with
        ``heat_redundant_broadcast``, without a merge).
      averaged_group: local index whose group did a blocking average, then broadcast it in the node.
      ended_epoch: this was the last batch of an epoch.
    """

    local_grad_sync: jax.Array
    sent_group: jax.Array
    sent_wait: jax.Array
    sent_low_precision: jax.Array
    merged_group: jax.Array
    merged_wait: jax.Array
    merged_delay: jax.Array
    merge_broadcast_root: jax.Array
    averaged_group: jax.Array
    ended_epoch: jax.Array


class DasoState(NamedTuple):
    """State of ``daso``. Replicated unless marked per replica.

    Attributes:
      batch_in_epoch: 0-based batch index in the current epoch (Heat ``current_batch``).
      epoch: completed epochs.
      global_skip: ``gs``, batches between global syncs (0: blocking phase, sync every batch).
      local_skip: ``ls``, period of the intra-node gradient averaging in the cycling phase.
      batches_to_wait: ``btw``, configured delay between a send and its merge (0: blocking).
      send_group: local index whose cross-node group sends at the next global sync (``send_mod``).
      previous_send_group: group of the last non-blocking send (``send_mod_m1``; -1: none).
      pending_sum: per replica: the cross-node sum of the parameters of this replica's group,
        computed at send time (float32 or wider), merged when the delay expires.
      pending_wait: ``B`` stored with the pending send.
      pending_sent_batch: batch index of the pending send.
      pending_valid: a send is outstanding.
      pending_low_precision: the pending send was made in ``downcast``.
      local_sync_next: average the *next* step's gradient over the node (``local_sync_on``).
      epoch_loss_sum: per replica: sum of this epoch's ``value=`` losses.
      epoch_loss_count: per replica: how many were passed.
      best_epoch_loss: the plateau detector's best mean epoch loss.
      plateau_bad_epochs: epochs since the last improvement.
      last_events: what the last update did (``DasoEvents``).
      inner_state: per replica: the local optimizer's state.
      daso_ledger: what was sent.
    """

    batch_in_epoch: jax.Array
    epoch: jax.Array
    global_skip: jax.Array
    local_skip: jax.Array
    batches_to_wait: jax.Array
    send_group: jax.Array
    previous_send_group: jax.Array
    pending_sum: Any
    pending_wait: jax.Array
    pending_sent_batch: jax.Array
    pending_valid: jax.Array
    pending_low_precision: jax.Array
    local_sync_next: jax.Array
    epoch_loss_sum: jax.Array
    epoch_loss_count: jax.Array
    best_epoch_loss: jax.Array
    plateau_bad_epochs: jax.Array
    last_events: DasoEvents
    inner_state: optax.OptState
    daso_ledger: CommLedger


def _i32(x) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _storage_dtype(dtype) -> jnp.dtype:
    """The pending sum is kept in float32 (or wider): it holds a bf16/fp16/fp32 sum exactly."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize > 4 else jnp.dtype(jnp.float32)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int ≥ {low}")


@configured("daso")
def daso(
    inner: optax.GradientTransformation,
    *,
    local_comm: Communicator,
    global_comm: Communicator,
    steps_per_epoch: int,
    total_epochs: int,
    warmup_epochs: int = 4,
    cooldown_epochs: int = 4,
    max_global_skips: int = 8,
    stability_level: float = 0.05,
    skip_reduction_factor: int = 2,
    local_skip_factor: int = 4,
    plateau_patience: int = 2,
    downcast: Any = "bfloat16",
    downcast_in_cycling: bool = True,
    first_cycle: str | tuple[int, int, int] = "max_global_skips",
    heat_redundant_broadcast: bool = False,
    merge_weight: str = "actual",
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""DASO (Heat): node-local gradient averaging plus delayed, selective cross-node parameter merges.

    Replicas form ``N`` nodes of ``G`` (``global_comm`` = the replicas with my local index on every
    node, Heat's group ``C_k``; ``local_comm`` = my node). Each ``update`` is one batch ``b`` of
    an epoch of ``steps_per_epoch`` batches (``L = steps_per_epoch − 1``), with the schedule
    ``(gs, ls, btw)`` in the state:

    1. If the previous step set ``local_sync_next``: :math:`g \leftarrow \frac1G\sum_{node} g`.
    2. Local step: :math:`p \leftarrow p + \mathrm{inner}(g)`.
    3. **Global sync** on batches with ``b mod gs = 0`` and on the last batch (every batch when
       ``gs = 0``): group ``k = send_group`` *sends* :math:`S = \sum_{n} p_{n,k}` (all-reduce over
       ``global_comm`` in ``downcast``), to be merged after
       :math:`B = \min(btw, L - b)` batches. Non-blocking (``btw > 0`` and not the last batch):
       the group rotates, ``k ← (k+1) mod G``. Blocking (``btw = 0`` or the last batch):
       :math:`p \leftarrow S / N` on group ``k``, broadcast within each node from local index ``k``.
    4. **Merge** ``B`` batches after a non-blocking send (or at the next global sync if that comes
       first), on the sending group, then broadcast within the node from it:

       .. math:: p \leftarrow \frac{2D\,p + S}{2D + N}

       with :math:`D` the batches elapsed since the send (``merge_weight="actual"``) or the stored
       :math:`B` (``"heat"``; 1 instead of 0). The receiver's newer parameters weigh :math:`2D`,
       each node's stale copy (its own included) weighs 1.
    5. Intra-node gradient averaging for the next step: on in blocking phases; in cycling on
       batches ``b mod ls = 0``, around global syncs and on the last batch (Heat's rules).
    6. **Epoch end** (last batch): every replica holds the same parameters; the mean of the
       epoch's ``value=`` losses over all replicas feeds a plateau detector (relative threshold
       ``stability_level``, patience ``plateau_patience``). Epochs ``< warmup_epochs`` and the last
       ``cooldown_epochs`` are blocking (``gs = ls = btw = 0``); cycling starts at ``first_cycle``;
       on a plateau ``gs //= f, ls //= f, btw −= 1`` (``f = skip_reduction_factor``, ``ls, btw ≥ 1``
       while ``gs > 0``), and from ``gs = 1`` a plateau resets to
       ``(max_global_skips, max_global_skips // local_skip_factor, same)``.

    Pass the batch loss as ``update(grads, state, params, value=loss)``; without it the plateau
    detector is not fed and the cycle stays at ``first_cycle``. The update is ``target − params``.

    Communication (``P`` = parameter bytes, ``P_w`` = parameter bytes in the wire dtype):
      * intra-node (``local_comm``): a gradient all-reduce of ``P`` on local-sync steps
        (``local:all_reduce[<dtype>]``); a parameter broadcast of ``P`` after every merge and
        blocking average (``local:broadcast[<dtype>]``).
      * cross-node (``global_comm``): on every global sync one all-reduce of ``P_w``
        (``global:all_reduce[<wire>]``). SPMD runs it in all ``G`` groups at once and keeps group
        ``k``'s result, so each replica sends ``P_w`` per sync (Heat: one GPU per node does).
      * once per epoch: the loss (8 bytes) over ``local_comm`` then ``global_comm``
        (``local:loss_all_reduce[float32]``, ``global:loss_all_reduce[float32]``) and the plateau
        decision (4 bytes, ``local:agree[int32]``, ``global:agree[int32]``).
      Groups of one send nothing and count nothing.

    Args:
      inner: the local optimizer (Heat: torch SGD).
      local_comm: the replicas of my node (``Hierarchy.local``); ``G`` = its size.
      global_comm: the replicas with my local index on every node (``Hierarchy.cross``).
      steps_per_epoch: batches per epoch (Heat ``last_batch + 1``).
      total_epochs: planned epochs (places the cool-down).
      warmup_epochs: blocking epochs at the start (Heat 4); 0 starts cycling at once.
      cooldown_epochs: blocking epochs at the end (Heat 4).
      max_global_skips: ``gs`` after a reset (Heat 8).
      stability_level: relative improvement the plateau detector asks for (Heat 0.05).
      skip_reduction_factor: divisor of ``gs`` and ``ls`` on a plateau (Heat 2, ≥ 2).
      local_skip_factor: ``ls = btw = max_global_skips // local_skip_factor`` on reset (Heat 4).
      plateau_patience: non-improving epochs tolerated before a plateau (Heat 2: the third one).
      downcast: wire dtype of the cross-node sum: ``"bfloat16"`` (Heat), ``"float16"``,
        ``"float32"`` or None (the parameters' dtype).
      downcast_in_cycling: use ``downcast`` in every phase, as Heat documents. False reproduces
        Heat's code: ``downcast`` only in blocking phases, float32 while cycling (H1).
      first_cycle: ``(gs, ls, btw)`` when cycling starts: ``"max_global_skips"`` (Heat's docs:
        ``(max_gs, max_gs // local_skip_factor, same)``), ``"heat"`` (Heat's code: ``(4, 1, 1)``)
        or an explicit tuple.
      heat_redundant_broadcast: reproduce Heat's broadcast from the previous sending group at every
        global sync even when its send was already merged (H3).
      merge_weight: ``"actual"`` (batches elapsed since the send) or ``"heat"`` (the stored ``B``,
        which can be smaller near the epoch end, H2).
      nonfinite: a local step whose update is not finite is skipped (``"skip"``, the default: zero
        update, inner state kept; the local step follows the node's gradient average, so one bad
        gradient makes its node skip) or applied as it is (``"ignore"``, no cost).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state ``DasoState``.

    Example:
      >>> h = optaxdist.axis_hierarchy(2, 4)
      >>> tx = daso(optax.sgd(0.1), local_comm=h.local, global_comm=h.cross,
      ...           steps_per_epoch=100, total_epochs=90)
      >>> updates, state = tx.update(grads, state, params, value=loss)  # doctest: +SKIP

    References:
      Coquelin et al., "Accelerating neural network training with distributed asynchronous and
      selective optimization (DASO)", Journal of Big Data 9, 2022 (arXiv:2104.05588).
      Heat ``heat.optim.DASO``.
    """
    for name, c in (("local_comm", local_comm), ("global_comm", global_comm)):
        if not isinstance(c, Communicator):
            raise TypeError(f"{name} must be an optaxdist Communicator, got {type(c).__name__}")
    _check_int("steps_per_epoch", steps_per_epoch, 1)
    _check_int("total_epochs", total_epochs, 1)
    _check_int("warmup_epochs", warmup_epochs, 0)
    _check_int("cooldown_epochs", cooldown_epochs, 0)
    _check_int("max_global_skips", max_global_skips, 1)
    _check_int("skip_reduction_factor", skip_reduction_factor, 2)
    _check_int("local_skip_factor", local_skip_factor, 1)
    _check_int("plateau_patience", plateau_patience, 0)
    if max_global_skips // local_skip_factor < 1:
        raise ValueError(
            f"max_global_skips={max_global_skips} < local_skip_factor={local_skip_factor} gives "
            "local_skip = batches_to_wait = 0 after a reset (every sync blocking); use "
            "max_global_skips ≥ local_skip_factor"
        )
    if not 0 <= stability_level < 1:
        raise ValueError(f"stability_level={stability_level!r} must be in [0, 1)")
    low = canonical_comm_dtype(downcast, name="downcast")
    check_nonfinite(nonfinite)
    if merge_weight not in MERGE_WEIGHTS:
        raise ValueError(f"merge_weight={merge_weight!r}; allowed: {MERGE_WEIGHTS}")
    reset_cycle = (
        max_global_skips,
        max_global_skips // local_skip_factor,
        max_global_skips // local_skip_factor,
    )
    if isinstance(first_cycle, str):
        if first_cycle not in FIRST_CYCLES:
            raise ValueError(f"first_cycle={first_cycle!r}; allowed: {FIRST_CYCLES} or a tuple (gs, ls, btw)")
        start_cycle = reset_cycle if first_cycle == "max_global_skips" else HEAT_FIRST_CYCLE
    else:
        cycle = tuple(first_cycle) if isinstance(first_cycle, (tuple, list)) else ()
        if (
            len(cycle) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in cycle)
            or cycle[0] < 1
            or cycle[1] < 1
            or cycle[2] < 0
        ):
            raise ValueError(
                f"first_cycle={first_cycle!r} must be {FIRST_CYCLES[0]!r}, {FIRST_CYCLES[1]!r} or a "
                "tuple of ints (gs ≥ 1, ls ≥ 1, btw ≥ 0)"
            )
        start_cycle = cycle
    # The cycling wire dtype: `downcast` (documented) or float32 (Heat's code).
    cycle_wire = low if downcast_in_cycling else jnp.dtype(jnp.float32)
    two_wires = low != cycle_wire
    last_batch = steps_per_epoch - 1
    cool_start = total_epochs - cooldown_epochs
    inner = optax.with_extra_args_support(inner)

    def vary(tree):
        return per_replica(per_replica(tree, local_comm), global_comm)

    def phase_cycle(epoch):
        """Whether ``epoch`` is a blocking (warm-up / cool-down) epoch, and whether cycling starts."""
        blocking = (epoch < warmup_epochs) | (epoch >= cool_start)
        start = epoch == warmup_epochs
        return blocking, start

    def kinds(params) -> dict[str, int]:
        out = {
            kind_name("local:all_reduce", params): payload_bytes(params),
            kind_name("local:broadcast", params): payload_bytes(params),
            kind_name("global:all_reduce", params, low): payload_bytes(params, low),
        }
        if two_wires:
            out[kind_name("global:all_reduce", params, cycle_wire)] = payload_bytes(params, cycle_wire)
        out.update({LOSS_LOCAL_KIND: 8, LOSS_GLOBAL_KIND: 8, AGREE_LOCAL_KIND: 4, AGREE_GLOBAL_KIND: 4})
        return out

    def no_events() -> DasoEvents:
        minus = _i32(NO_GROUP)
        no = jnp.asarray(False)
        return DasoEvents(no, minus, _i32(0), no, minus, _i32(0), _i32(0), minus, minus, no)

    def init_fn(params):
        blocking, _ = phase_cycle(0)
        gs, ls, btw = (0, 0, 0) if blocking else start_cycle
        pending = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _storage_dtype(p.dtype)), params)
        return DasoState(
            batch_in_epoch=_i32(0),
            epoch=_i32(0),
            global_skip=_i32(gs),
            local_skip=_i32(ls),
            batches_to_wait=_i32(btw),
            send_group=_i32(0),
            previous_send_group=_i32(NO_GROUP),
            pending_sum=vary(pending),
            pending_wait=_i32(0),
            pending_sent_batch=_i32(0),
            pending_valid=jnp.asarray(False),
            pending_low_precision=jnp.asarray(False),
            local_sync_next=jnp.asarray(True),
            epoch_loss_sum=vary(jnp.zeros((), jnp.float32)),
            epoch_loss_count=vary(_i32(0)),
            best_epoch_loss=jnp.asarray(jnp.inf, jnp.float32),
            plateau_bad_epochs=_i32(0),
            last_events=no_events(),
            inner_state=vary(inner.init(params)),
            daso_ledger=CommLedger.create(kinds(params)),
        )

    def update_fn(updates, state, params=None, *, value=None, **extra):
        if params is None:
            raise ValueError("daso needs params: call update(updates, state, params, value=loss)")
        G, N = local_comm.size, global_comm.size
        # The replicated control state, seen as uniform so that every cond/switch below stays a
        # branch under simulate (see Communicator.uniform).
        control = (
            "batch_in_epoch", "epoch", "global_skip", "local_skip", "batches_to_wait", "send_group",
            "previous_send_group", "pending_wait", "pending_sent_batch", "pending_valid",
            "pending_low_precision", "local_sync_next", "plateau_bad_epochs",
        )  # fmt: skip
        uniform = global_comm.uniform(local_comm.uniform({k: getattr(state, k) for k in control}))
        s = state._replace(**uniform)
        ledger = s.daso_ledger

        # ---- the batch's control flow (Heat DASO.step / _global_sync), on replicated scalars ----
        b, gs, ls, cfg = s.batch_in_epoch, s.global_skip, s.local_skip, s.batches_to_wait
        nb = b + 1
        gmod = jnp.where(gs > 0, b % jnp.maximum(gs, 1), 0)
        lmod = jnp.where(ls > 0, b % jnp.maximum(ls, 1), 0)
        btw = jnp.where(cfg + b <= last_batch, cfg, last_batch - b)
        last = b == last_batch
        is_sync = last | (gmod == 0)
        before_sync = ~is_sync & (nb % jnp.maximum(gs, 1) == 0)
        waiting = ~is_sync & ~before_sync & (gmod < btw)
        rest = ~is_sync & ~before_sync & ~waiting
        receive_in_step = rest & (gmod == btw)
        try_receive = receive_in_step | (is_sync & (cfg != 0))
        merge = try_receive & s.pending_valid
        have_prev = s.previous_send_group >= 0
        bcast_prev = try_receive & have_prev & (s.pending_valid | heat_redundant_broadcast)
        blocking = is_sync & (last | (cfg == 0))
        send_low = jnp.asarray(True) if not two_wires else (gs < 1)

        lso = s.local_sync_next
        l_rest = jnp.where(receive_in_step & (ls > 1), False, lso)
        l_rest = jnp.where(lmod == 0, False, jnp.where(nb % jnp.maximum(ls, 1) == 0, True, l_rest))
        l_rest = jnp.where(nb == last_batch, True, l_rest)
        l_rest = jnp.where((ls == 1) & (nb != last_batch), True, l_rest)
        new_lso = jnp.where(
            is_sync,
            lso,
            jnp.where(before_sync, True, jnp.where(waiting, lso | (nb == last_batch), l_rest)),
        )
        delay = b - s.pending_sent_batch

        # ---- 1. intra-node gradient averaging (decided by the previous step) ----
        if G > 1:
            grad_kind = kind_name("local:all_reduce", updates)

            def average_grads(operand):
                g, led = operand
                return vary(local_comm.pmean(g)), led.record(grad_kind)

            updates, ledger = jax.lax.cond(
                lso, average_grads, lambda o: (vary(o[0]), o[1]), (updates, ledger)
            )

        # ---- 2. local step ----
        if value is not None:
            extra = extra | {"value": value}
        local_updates, inner_state = local_step(
            inner, updates, s.inner_state, params, nonfinite=nonfinite, **extra
        )
        local = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, local_updates)

        # ---- 3. send: every group all-reduces over global_comm; group send_group keeps it ----
        def send(wire):
            kind = kind_name("global:all_reduce", params, wire)

            def branch(operand):
                _, led = operand
                # The sum is computed in `wire` (None: each leaf's own dtype) and comes back in
                # the dtype handed over: the float32 storage keeps a float32 sum of bf16 params.
                packed = (
                    local
                    if wire is None
                    else jax.tree.map(lambda x: x.astype(_storage_dtype(x.dtype)), local)
                )
                if N > 1:
                    summed = global_comm.psum(packed, dtype=wire)
                    led = led.record(kind)
                else:  # a group of one: the "sum" is the value on the wire
                    summed = jax.tree.map(
                        lambda x: x if wire is None else x.astype(wire).astype(x.dtype), packed
                    )
                stored = jax.tree.map(lambda x: x.astype(_storage_dtype(x.dtype)), summed)
                return vary(stored), led

            return branch

        send_branches = [lambda o: (vary(o[0]), o[1]), send(low)]
        if two_wires:
            send_branches.append(send(cycle_wire))
        send_index = jnp.where(is_sync, jnp.where(send_low, 1, len(send_branches) - 1), 0)
        sent, ledger = jax.lax.switch(send_index, send_branches, (s.pending_sum, ledger))

        # ---- 4. merge the older pending send, broadcast within the node ----
        bcast_kind = kind_name("local:broadcast", params)

        def broadcast_from(tree, root, led):
            if G == 1:
                return tree, led
            branches = [functools.partial(local_comm.broadcast, root=r) for r in range(G)]
            return jax.lax.switch(root, branches, tree), led.record(bcast_kind)

        def divide(total, denom, is_low, p):
            """``total / denom`` in the send's wire dtype (Heat divides in the buffer dtype)."""

            def in_wire(wire):
                w = p.dtype if wire is None else wire
                return (total.astype(w) / denom.astype(w)).astype(p.dtype)

            if not two_wires:
                return in_wire(low)
            return jnp.where(is_low, in_wire(low), in_wire(cycle_wire))

        def merge_then_broadcast(operand):
            p, led = operand
            if merge_weight == "actual":
                numer = 2 * delay
            else:
                numer = jnp.where(s.pending_wait > 0, 2 * s.pending_wait, 1)
            denom = (numer + N).astype(jnp.float32)
            factor = numer.astype(jnp.float32) / denom
            merged = jax.tree.map(
                lambda x, tot: x * factor.astype(x.dtype) + divide(tot, denom, s.pending_low_precision, x),
                p,
                s.pending_sum,
            )
            out, led = broadcast_from(merged, s.previous_send_group, led)
            return vary(out), led

        def broadcast_only(operand):
            p, led = operand
            out, led = broadcast_from(p, s.previous_send_group, led)
            return vary(out), led

        merge_mode = jnp.where(merge, 1, jnp.where(bcast_prev, 2, 0))
        target, ledger = jax.lax.switch(
            merge_mode,
            [lambda o: (vary(o[0]), o[1]), merge_then_broadcast, broadcast_only],
            (local, ledger),
        )

        # ---- 5. blocking average of the send just made, broadcast within the node ----
        def average_then_broadcast(operand):
            p, led = operand
            n = jnp.asarray(N, jnp.float32)
            avg = jax.tree.map(lambda x, tot: divide(tot, n, send_low, x), p, sent)
            out, led = broadcast_from(avg, s.send_group, led)
            return vary(out), led

        target, ledger = jax.lax.cond(
            blocking, average_then_broadcast, lambda o: (vary(o[0]), o[1]), (target, ledger)
        )

        # ---- 6. epoch end: mean loss over all replicas, plateau detector, next (gs, ls, btw) ----
        loss_sum, loss_count = s.epoch_loss_sum, s.epoch_loss_count
        if value is not None:
            loss_sum = loss_sum + jnp.mean(jnp.asarray(value).astype(jnp.float32))
            loss_count = loss_count + 1

        def reduce_loss(led):
            both = jnp.stack([loss_sum, loss_count.astype(jnp.float32)])
            both = local_comm.psum(both)
            both = global_comm.psum(both)
            total, count = both[0], both[1]
            mean = total / jnp.maximum(count, 1.0)
            best = s.best_epoch_loss
            better = jnp.where(
                best >= 0,
                mean < best * (1 - stability_level),
                mean < best * (1 + stability_level),
            ) & (count > 0)
            # Make the decision bit-identical everywhere (it gates later collectives).
            better = global_comm.agree(local_comm.agree(better, op="all"), op="all")
            if G > 1:
                led = led.record(LOSS_LOCAL_KIND).record(AGREE_LOCAL_KIND)
            if N > 1:
                led = led.record(LOSS_GLOBAL_KIND).record(AGREE_GLOBAL_KIND)
            return mean, count > 0, better, led

        def no_loss(led):
            return jnp.asarray(jnp.nan, jnp.float32), jnp.asarray(False), jnp.asarray(False), led

        mean_loss, have_loss, better, ledger = jax.lax.cond(last, reduce_loss, no_loss, ledger)

        new_epoch = s.epoch + jnp.where(last, 1, 0).astype(jnp.int32)
        in_blocking, at_start = phase_cycle(new_epoch)
        gs1 = jnp.where(at_start, start_cycle[0], gs)
        ls1 = jnp.where(at_start, start_cycle[1], ls)
        cfg1 = jnp.where(at_start, start_cycle[2], cfg)
        feed = last & ~in_blocking & have_loss
        bad = jnp.where(feed, jnp.where(better, 0, s.plateau_bad_epochs + 1), s.plateau_bad_epochs)
        best = jnp.where(feed & better, mean_loss, s.best_epoch_loss)
        plateau = feed & (bad > plateau_patience)
        bad = jnp.where(plateau, 0, bad)
        reduce = plateau & (gs1 > 1)
        reset = plateau & (gs1 == 1)
        gs2 = gs1 // skip_reduction_factor
        ls2 = jnp.where(gs2 > 0, jnp.maximum(ls1 // skip_reduction_factor, 1), ls1 // skip_reduction_factor)
        cfg2 = jnp.where(gs2 > 0, jnp.maximum(cfg1 - 1, 1), jnp.maximum(cfg1 - 1, 0))
        gs3 = jnp.where(reduce, gs2, jnp.where(reset, reset_cycle[0], gs1))
        ls3 = jnp.where(reduce, ls2, jnp.where(reset, reset_cycle[1], ls1))
        cfg3 = jnp.where(reduce, cfg2, jnp.where(reset, reset_cycle[2], cfg1))
        new_gs = jnp.where(last, jnp.where(in_blocking, 0, gs3), gs)
        new_ls = jnp.where(last, jnp.where(in_blocking, 0, ls3), ls)
        new_cfg = jnp.where(last, jnp.where(in_blocking, 0, cfg3), cfg)

        # ---- bookkeeping of the global sync ----
        nonblocking_send = is_sync & ~blocking
        new_send_group = jnp.where(is_sync, jnp.where(last, 0, (s.send_group + 1) % G), s.send_group)
        new_prev = jnp.where(is_sync, jnp.where(blocking, NO_GROUP, s.send_group), s.previous_send_group)
        minus = _i32(NO_GROUP)
        events = DasoEvents(
            local_grad_sync=lso,
            sent_group=jnp.where(is_sync, s.send_group, minus),
            sent_wait=jnp.where(is_sync, btw, 0).astype(jnp.int32),
            sent_low_precision=is_sync & send_low,
            merged_group=jnp.where(merge, s.previous_send_group, minus),
            merged_wait=jnp.where(merge, s.pending_wait, 0).astype(jnp.int32),
            merged_delay=jnp.where(merge, delay, 0).astype(jnp.int32),
            merge_broadcast_root=jnp.where((merge | bcast_prev) & (G > 1), s.previous_send_group, minus),
            averaged_group=jnp.where(blocking, s.send_group, minus),
            ended_epoch=last,
        )
        out = jax.tree.map(lambda t, p: (t - p).astype(p.dtype), target, params)
        return out, DasoState(
            batch_in_epoch=jnp.where(last, 0, nb).astype(jnp.int32),
            epoch=new_epoch,
            global_skip=new_gs.astype(jnp.int32),
            local_skip=new_ls.astype(jnp.int32),
            batches_to_wait=new_cfg.astype(jnp.int32),
            send_group=new_send_group.astype(jnp.int32),
            previous_send_group=new_prev.astype(jnp.int32),
            pending_sum=sent,
            pending_wait=jnp.where(nonblocking_send, btw, s.pending_wait).astype(jnp.int32),
            pending_sent_batch=jnp.where(nonblocking_send, b, s.pending_sent_batch).astype(jnp.int32),
            pending_valid=jnp.where(is_sync, ~blocking, s.pending_valid & ~merge),
            pending_low_precision=jnp.where(nonblocking_send, send_low, s.pending_low_precision),
            local_sync_next=new_lso,
            epoch_loss_sum=jnp.where(last, 0.0, loss_sum).astype(jnp.float32),
            epoch_loss_count=jnp.where(last, 0, loss_count).astype(jnp.int32),
            best_epoch_loss=best.astype(jnp.float32),
            plateau_bad_epochs=bad.astype(jnp.int32),
            last_events=events,
            inner_state=inner_state,
            daso_ledger=ledger,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
