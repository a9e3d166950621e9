"""DASO: Distributed Asynchronous and Selective Optimization (Heat ``heat.optim.DASO``).

Two levels of replicas: ``G`` replicas per node (fast links) and ``N`` nodes (slow links). Inside a
node the gradients are averaged on some steps; across nodes the *parameters* are averaged every
``global_skip`` steps by one cross-node group at a time, and the result is merged ``B`` steps later
with a weight that favours the receiver's newer parameters. An epoch-level state machine (warm-up,
cycling with a plateau detector on the training loss, cool-down) chooses how often to sync.

Everything Heat keeps on the host lives here in the optimizer state: the user calls ``update``
once per batch, passing the batch loss as ``value=``. The schedule is two pure functions of
replicated scalars, ``batch_plan`` (what this batch does) and ``next_cycle`` (the epoch-end state
machine); ``daso`` runs the collectives they ask for inside ``lax.cond`` / ``lax.switch``, or, in
a harness's program of one kind of batch (``split_local_steps=True``), without a conditional.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger, Kind, kind_name, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, as_bits, canonical_comm_dtype
from optaxdist.transforms._checks import check_comm, check_nonfinite, check_number, check_state, local_step
from optaxdist.transforms.local_program import Schedule, mark_flags, next_update, record
from optaxdist.transforms.periodic import AGREED, UNTOUCHED, AgreedParams, initial_agreed, record_agreed

NO_GROUP = -1

LOSS_KINDS = tuple(
    Kind("all_reduce", "float32", label="loss_all_reduce", scope=s) for s in ("local", "cross")
)
AGREE_KINDS = tuple(Kind("all_reduce", "int32", label="agree", scope=s) for s in ("local", "cross"))


class HeatQuirks(NamedTuple):
    """Where Heat's code departs from its documentation (``seeds_spec.md``, H1–H3 and H6). Off by
    default; ``HeatQuirks.all()`` reproduces Heat's code, single fields isolate one quirk.

    Attributes:
      float32_cycling: (H1) ``downcast`` only in blocking phases; cycling sends float32.
      stored_merge_weight: (H2) the merge weighs the receiver's parameters by the ``B`` stored at
        send time (1 instead of 0), not by the batches actually elapsed (smaller near the epoch end).
      redundant_broadcast: (H3) at every non-blocking-phase global sync, broadcast within the node
        from the previous sending group even when its send was already merged.
      first_cycle: (H6) cycling starts at ``(gs, ls, btw) = (4, 1, 1)`` instead of
        ``(max_global_skips, max_global_skips // local_skip_factor, same)``.
    """

    float32_cycling: bool = False
    stored_merge_weight: bool = False
    redundant_broadcast: bool = False
    first_cycle: bool = False

    @classmethod
    def all(cls) -> HeatQuirks:
        return cls(True, True, True, True)


HEAT_FIRST_CYCLE = (4, 1, 1)


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
        the redundant-broadcast quirk, without a merge).
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
        computed at a non-blocking send (float32 or wider), merged when the delay expires; a
        blocking average leaves it as it was.
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
      agreed: with ``exact_sync``, the parameters the last merge broadcast or blocking average
        set (``AgreedParams``, read by ``optaxdist.sync_params``), float leaves as their bit
        patterns (int32 for float32: the in-node broadcast's result, kept without a copy); ``()``
        without.
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
    agreed: AgreedParams | tuple[()] = ()

    def agreed_leaves(self, like: list) -> tuple[list, list]:
        """``AgreedParams.leaves`` for ``sync_params``."""
        return self.agreed.leaves(like)


class BatchPlan(NamedTuple):
    """What batch ``b`` of an epoch does (``batch_plan``; replicated scalars).

    Attributes:
      sync: a global sync: this step's parameters are summed over ``cross_comm``.
      blocking: the sync is averaged at once (``btw = 0`` or the last batch), not merged later.
      wait: ``B``, batches from the send to its merge (``btw`` clamped to the epoch's end).
      merge: the pending send is merged on this step.
      broadcast_previous: the previous sending group broadcasts within the node on this step.
      local_sync_next: the next step's gradients are averaged over the node.
    """

    sync: jax.Array
    blocking: jax.Array
    wait: jax.Array
    merge: jax.Array
    broadcast_previous: jax.Array
    local_sync_next: jax.Array


def _rem(count: jax.Array, skip: jax.Array) -> jax.Array:
    """``count % max(skip, 1)`` for a count and a skip that are never negative: one integer
    remainder (``%`` on arrays is Python's modulo, which corrects the sign of a negative one)."""
    return jax.lax.rem(count, jnp.maximum(skip, 1))


def batch_plan(
    b: jax.Array,
    cycle: tuple[jax.Array, jax.Array, jax.Array],
    *,
    local_sync: jax.Array,
    pending_valid: jax.Array,
    have_previous: jax.Array,
    last_batch: int,
    redundant_broadcast: bool = False,
) -> BatchPlan:
    """Heat's per-batch rules (``DASO.step`` / ``_global_sync``) for batch ``b`` of an epoch whose
    last batch is ``last_batch``, in the cycle ``(gs, ls, btw)``; ``local_sync`` says whether this
    batch's gradients were averaged over the node."""
    gs, ls, btw = cycle
    wait = jnp.where(btw + b <= last_batch, btw, last_batch - b)
    nb = b + 1
    gmod = jnp.where(gs > 0, _rem(b, gs), 0)
    lmod = jnp.where(ls > 0, _rem(b, ls), 0)
    last = b == last_batch
    sync = last | (gmod == 0)
    before_sync = ~sync & (_rem(nb, gs) == 0)
    waiting = ~sync & ~before_sync & (gmod < wait)
    receive_in_step = ~sync & ~before_sync & ~waiting & (gmod == wait)
    try_receive = receive_in_step | (sync & (btw != 0))

    rest = jnp.where(receive_in_step & (ls > 1), False, local_sync)
    rest = jnp.where(lmod == 0, False, jnp.where(_rem(nb, ls) == 0, True, rest))
    rest = jnp.where(nb == last_batch, True, rest)
    rest = jnp.where((ls == 1) & (nb != last_batch), True, rest)
    local_sync_next = jnp.where(
        sync,
        local_sync,
        jnp.where(before_sync, True, jnp.where(waiting, local_sync | (nb == last_batch), rest)),
    )
    return BatchPlan(
        sync=sync,
        blocking=sync & (last | (btw == 0)),
        wait=wait,
        merge=try_receive & pending_valid,
        broadcast_previous=try_receive & have_previous & (pending_valid | redundant_broadcast),
        local_sync_next=local_sync_next,
    )


class CycleRules(NamedTuple):
    """The static parameters of ``next_cycle``."""

    warmup_epochs: int
    cooldown_start: int
    first_cycle: tuple[int, int, int]
    reset_cycle: tuple[int, int, int]
    reduction_factor: int
    patience: int


def next_cycle(
    epoch: jax.Array,
    cycle: tuple[jax.Array, jax.Array, jax.Array],
    bad_epochs: jax.Array,
    *,
    improved: jax.Array,
    have_loss: jax.Array,
    rules: CycleRules,
) -> tuple[tuple[jax.Array, jax.Array, jax.Array], jax.Array, jax.Array]:
    """The cycle ``(gs, ls, btw)`` for epoch ``epoch``, the count of non-improving epochs, and
    whether the mean loss of the epoch just ended is the new best (``improved``: the plateau
    detector's verdict on it, if ``have_loss``).

    Blocking ``(0, 0, 0)`` in the warm-up and cool-down; ``first_cycle`` when cycling starts; after
    more than ``patience`` non-improving epochs, ``gs //= f, ls //= f, btw −= 1`` (``ls, btw ≥ 1``
    while ``gs > 0``), or from ``gs = 1`` back to ``reset_cycle``.
    """
    blocking = (epoch < rules.warmup_epochs) | (epoch >= rules.cooldown_start)
    start = epoch == rules.warmup_epochs
    gs, ls, btw = (jnp.where(start, first, now) for first, now in zip(rules.first_cycle, cycle))
    feed = ~blocking & have_loss
    bad = jnp.where(feed, jnp.where(improved, 0, bad_epochs + 1), bad_epochs)
    plateau = feed & (bad > rules.patience)
    f = rules.reduction_factor
    reduced_gs = gs // f
    floor = jnp.where(reduced_gs > 0, 1, 0)
    reduced = (reduced_gs, jnp.maximum(ls // f, floor), jnp.maximum(btw - 1, floor))
    out = tuple(
        jnp.where(blocking, 0, jnp.where(plateau & (gs > 1), r, jnp.where(plateau & (gs == 1), z, c)))
        for r, z, c in zip(reduced, rules.reset_cycle, (gs, ls, btw))
    )
    return out, jnp.where(plateau, 0, bad), feed & improved


# What the schedule of the coming batches depends on (``Schedule.control_in``), but for the cycle
# an epoch's end sets from the loss; FLAGS are booleans.
CYCLE = ("global_skip", "local_skip", "batches_to_wait")
CONTROL = ("batch_in_epoch", *CYCLE, "send_group", "previous_send_group", "pending_valid", "local_sync_next")
FLAGS = ("pending_valid", "local_sync_next")


CHOICE_RADICES = (2, 3, 3, 2)  # how many values each of the first four ``Choices`` takes


class Choices(NamedTuple):
    """What one batch's update runs: traced values in the general program, Python values in a
    harness's program of one branch (``Choices.of``; ``optaxdist.transforms.local_program``).

    Attributes:
      local_sync: average the gradients over the node first (decided by the batch before).
      send: 0 no global sync; 1 a send in ``downcast``; 2 in the cycling wire (float32 quirk).
      merge: 0 nothing; 1 merge the pending send, then broadcast within the node; 2 broadcast only.
      blocking: average the send just made, then broadcast it within the node.
      last: the epoch's last batch (the loss's all-reduce; only the general program runs it).
    """

    local_sync: Any
    send: Any
    merge: Any
    blocking: Any
    last: Any

    def code(self) -> jax.Array:
        """The branch these traced choices make (0: the local step alone): their digits, in the
        radices ``CHOICE_RADICES``."""
        code, weight = _i32(0), 1
        for choice, radix in zip(self, CHOICE_RADICES):
            code, weight = code + weight * _i32(choice), weight * radix
        return code

    @classmethod
    def of(cls, code: int) -> Choices:
        """The choices of branch ``code``, not at an epoch's end."""
        digits = []
        for radix in CHOICE_RADICES:
            code, digit = divmod(code, radix)
            digits.append(digit)
        local_sync, send, merge, blocking = digits
        return cls(bool(local_sync), send, merge, bool(blocking), False)


def _pick(pred: Any, a: Any, b: Any) -> Any:
    """``jnp.where(pred, a, b)``; ``a`` or ``b`` itself where ``pred`` is a Python bool."""
    if isinstance(pred, bool):
        return a if pred else b
    return jnp.where(pred, a, b)


def _i32(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.int32)


def _flag(x: Any) -> jax.Array:
    return jnp.asarray(x, jnp.bool_)


def _storage_dtype(dtype) -> jnp.dtype:
    """The pending sum is kept in float32 (or wider): it holds a bf16/fp16/fp32 sum exactly."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype.itemsize > 4 else jnp.dtype(jnp.float32)


def _check_cycle(first_cycle: Any) -> tuple[int, int, int]:
    if not isinstance(first_cycle, (tuple, list)) or len(first_cycle) != 3:
        raise ValueError(f"first_cycle={first_cycle!r} must be None or a tuple (gs ≥ 1, ls ≥ 1, btw ≥ 0)")
    name = f"first_cycle={tuple(first_cycle)!r}: "
    gs, ls, btw = (
        check_int(name + n, v, low) for n, v, low in zip(("gs", "ls", "btw"), first_cycle, (1, 1, 0))
    )
    return gs, ls, btw


@configured("daso")
def daso(
    inner: optax.GradientTransformation,
    *,
    local_comm: Communicator,
    cross_comm: Communicator,
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
    first_cycle: tuple[int, int, int] | None = None,
    heat_quirks: HeatQuirks | None = None,
    nonfinite: str = "skip",
    exact_sync: bool = True,
) -> optax.GradientTransformationExtraArgs:
    r"""DASO (Heat): node-local gradient averaging plus delayed, selective cross-node parameter merges.

    Replicas form ``N`` nodes of ``G`` (``cross_comm`` = the replicas with my local index on every
    node, Heat's group ``C_k``; ``local_comm`` = my node). Each ``update`` is one batch ``b`` of
    an epoch of ``steps_per_epoch`` batches (``L = steps_per_epoch − 1``), with the schedule
    ``(gs, ls, btw)`` in the state (``batch_plan``):

    1. If the previous step set ``local_sync_next``: :math:`g \leftarrow \frac1G\sum_{node} g`.
    2. Local step: :math:`p \leftarrow p + \mathrm{inner}(g)`.
    3. **Global sync** on batches with ``b mod gs = 0`` and on the last batch (every batch when
       ``gs = 0``): group ``k = send_group`` *sends* :math:`S = \sum_{n} p_{n,k}` (all-reduce over
       ``cross_comm`` in ``downcast``), to be merged after
       :math:`B = \min(btw, L - b)` batches. Non-blocking (``btw > 0`` and not the last batch):
       the group rotates, ``k ← (k+1) mod G``. Blocking (``btw = 0`` or the last batch):
       :math:`p \leftarrow S / N` on group ``k``, broadcast within each node from local index ``k``.
    4. **Merge** ``B`` batches after a non-blocking send (or at the next global sync if that comes
       first), on the sending group, then broadcast within the node from it:

       .. math:: p \leftarrow \frac{2D\,p + S}{2D + N}

       with :math:`D` the batches elapsed since the send. The receiver's newer parameters weigh
       :math:`2D`, each node's stale copy (its own included) weighs 1.
    5. Intra-node gradient averaging for the next step: on in blocking phases; in cycling on
       batches ``b mod ls = 0``, around global syncs and on the last batch (Heat's rules).
    6. **Epoch end** (last batch): every replica holds the same parameters; the mean of the
       epoch's ``value=`` losses over all replicas feeds a plateau detector (relative threshold
       ``stability_level``, patience ``plateau_patience``) and ``next_cycle``: epochs
       ``< warmup_epochs`` and the last ``cooldown_epochs`` are blocking (``gs = ls = btw = 0``);
       cycling starts at ``first_cycle``; on a plateau ``gs //= f, ls //= f, btw −= 1``
       (``f = skip_reduction_factor``, ``ls, btw ≥ 1`` while ``gs > 0``), and from ``gs = 1`` a
       plateau resets to ``(max_global_skips, max_global_skips // local_skip_factor, same)``.

    Pass the batch loss as ``update(grads, state, params, value=loss)``; without it the plateau
    detector is not fed and the cycle stays at ``first_cycle``. The update is ``target − params``.

    Communication (``P`` = parameter bytes, ``P_w`` = parameter bytes in the wire dtype):
      * intra-node (``local_comm``): a gradient all-reduce of ``P`` on local-sync steps
        (``local:all_reduce[<dtype>]``); a parameter broadcast of ``P`` after every merge and
        blocking average (``local:broadcast[<dtype>]``).
      * cross-node (``cross_comm``): on every global sync one all-reduce of ``P_w``
        (``cross:all_reduce[<wire>]``). SPMD runs it in all ``G`` groups at once and keeps group
        ``k``'s result, so each replica sends ``P_w`` per sync (Heat: one GPU per node does).
      * once per epoch: the loss (8 bytes) over ``local_comm`` then ``cross_comm``
        (``local:loss_all_reduce[float32]``, ``cross:loss_all_reduce[float32]``) and the plateau
        decision (4 bytes, ``local:agree[int32]``, ``cross:agree[int32]``).
      Groups of one send nothing and count nothing.

    Args:
      inner: the local optimizer (Heat: torch SGD).
      local_comm: the replicas of my node (``Hierarchy.local``); ``G`` = its size.
      cross_comm: the replicas with my local index on every node (``Hierarchy.cross``).
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
      first_cycle: ``(gs, ls, btw)`` when cycling starts (None: ``(max_global_skips,
        max_global_skips // local_skip_factor, same)``, as Heat documents).
      heat_quirks: reproduce Heat's code where it departs from its documentation
        (``HeatQuirks.all()``, or single quirks; see ``HeatQuirks``). An explicit ``first_cycle``
        wins over the ``first_cycle`` quirk.
      nonfinite: a local step whose update is not finite is skipped
        (``"skip"``, the default: zero update, inner state kept; the local step follows the node's
        gradient average, so one bad gradient makes its node skip) or applied as it is
        (``"ignore"``, no cost).
      exact_sync: keep the parameters each merge broadcast and blocking average sets, as the
        broadcast's bit patterns (``DasoState.agreed``: one parameter-sized buffer), so that
        ``optaxdist.apply_updates`` leaves the replicas of a node (after a blocking average: all
        replicas) holding exactly the same bits.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with state ``DasoState``.

    Example:
      >>> h = optaxdist.axis_hierarchy(2, 4)  # 2 simulated nodes of 4 replicas
      >>> tx = daso(optax.sgd(0.1), local_comm=h.local, cross_comm=h.cross,
      ...           steps_per_epoch=100, total_epochs=90)
      >>> def step(params, grads, loss):
      ...     updates, state = tx.update(grads, tx.init(params), params, value=loss)
      ...     return optax.apply_updates(params, updates)
      >>> run = optaxdist.simulate(step, axis_name=("node", "local"), shape=(2, 4))
      >>> grads = jnp.arange(8.0)[:, None] * jnp.ones((8, 2))  # replica i's gradient: i
      >>> # warm-up: node means (1.5 and 5.5), then a blocking average of the nodes' parameters,
      >>> # summed in bfloat16 (-0.35 in float32)
      >>> run(jnp.zeros((8, 2)), grads, jnp.ones(8))[0]
      Array([-0.3515625, -0.3515625], dtype=float32)

    References:
      Coquelin et al., "Accelerating neural network training with distributed asynchronous and
      selective optimization (DASO)", Journal of Big Data 9, 2022 (arXiv:2104.05588).
      Heat ``heat.optim.DASO``.
    """
    check_comm("local_comm", local_comm)
    check_comm("cross_comm", cross_comm)
    steps_per_epoch = check_int("steps_per_epoch", steps_per_epoch, 1)
    total_epochs = check_int("total_epochs", total_epochs, 1)
    warmup_epochs = check_int("warmup_epochs", warmup_epochs, 0)
    cooldown_epochs = check_int("cooldown_epochs", cooldown_epochs, 0)
    max_global_skips = check_int("max_global_skips", max_global_skips, 1)
    skip_reduction_factor = check_int("skip_reduction_factor", skip_reduction_factor, 2)
    local_skip_factor = check_int("local_skip_factor", local_skip_factor, 1)
    plateau_patience = check_int("plateau_patience", plateau_patience, 0)
    if max_global_skips // local_skip_factor < 1:
        raise ValueError(
            f"max_global_skips={max_global_skips} < local_skip_factor={local_skip_factor} gives "
            "local_skip = batches_to_wait = 0 after a reset (every sync blocking); use "
            "max_global_skips ≥ local_skip_factor"
        )
    check_number("stability_level", stability_level, 0, 1, open_high=True)
    low = canonical_comm_dtype(downcast, name="downcast")
    check_nonfinite(nonfinite)
    check_bools(exact_sync=exact_sync)
    quirks = HeatQuirks() if heat_quirks is None else heat_quirks
    if not isinstance(quirks, HeatQuirks):
        raise TypeError(f"heat_quirks must be None or a HeatQuirks, got {type(heat_quirks).__name__}")
    reset_cycle = (max_global_skips,) + (max_global_skips // local_skip_factor,) * 2
    if first_cycle is not None:
        start_cycle = _check_cycle(first_cycle)
    else:
        start_cycle = HEAT_FIRST_CYCLE if quirks.first_cycle else reset_cycle
    rules = CycleRules(
        warmup_epochs,
        total_epochs - cooldown_epochs,
        start_cycle,
        reset_cycle,
        skip_reduction_factor,
        plateau_patience,
    )
    # The cycling wire dtype: `downcast` (documented) or float32 (Heat's code).
    cycle_wire = jnp.dtype(jnp.float32) if quirks.float32_cycling else low
    two_wires = low != cycle_wire
    last_batch = steps_per_epoch - 1
    inner = optax.with_extra_args_support(inner)

    def vary(tree):
        return per_replica(per_replica(tree, local_comm), cross_comm)

    def kinds(params) -> dict[Kind, int]:
        out = {
            kind_name("all_reduce", params, scope="local"): payload_bytes(params),
            kind_name("broadcast", params, scope="local"): payload_bytes(params),
        }
        for wire in (low, cycle_wire) if two_wires else (low,):
            out[kind_name("all_reduce", params, wire, scope="cross")] = payload_bytes(params, wire)
        return out | dict.fromkeys(LOSS_KINDS, 8) | dict.fromkeys(AGREE_KINDS, 4)

    def init_fn(params):
        cycle = (0, 0, 0) if warmup_epochs > 0 or total_epochs <= cooldown_epochs else start_cycle
        minus, zero, no = jnp.int32(NO_GROUP), jnp.int32(0), jnp.asarray(False)
        return DasoState(
            batch_in_epoch=zero,
            epoch=zero,
            global_skip=jnp.int32(cycle[0]),
            local_skip=jnp.int32(cycle[1]),
            batches_to_wait=jnp.int32(cycle[2]),
            send_group=zero,
            previous_send_group=minus,
            pending_sum=vary(
                jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _storage_dtype(p.dtype)), params)
            ),
            pending_wait=zero,
            pending_sent_batch=zero,
            pending_valid=no,
            pending_low_precision=no,
            local_sync_next=jnp.asarray(True),
            epoch_loss_sum=vary(jnp.zeros((), jnp.float32)),
            epoch_loss_count=vary(zero),
            best_epoch_loss=jnp.asarray(jnp.inf, jnp.float32),
            plateau_bad_epochs=zero,
            last_events=DasoEvents(no, minus, zero, no, minus, zero, zero, minus, minus, no),
            inner_state=vary(inner.init(params)),
            daso_ledger=CommLedger.create(kinds(params)),
            agreed=initial_agreed(params, vary, "bits") if exact_sync else (),
        )

    def plan_of(c: Mapping[str, Any]) -> BatchPlan:
        """This batch's plan, from the control values ``c`` (``CONTROL``)."""
        return batch_plan(
            c["batch_in_epoch"],
            (c["global_skip"], c["local_skip"], c["batches_to_wait"]),
            local_sync=c["local_sync_next"],
            pending_valid=c["pending_valid"],
            have_previous=c["previous_send_group"] >= 0,
            last_batch=last_batch,
            redundant_broadcast=quirks.redundant_broadcast,
        )

    def sends_low(c: Mapping[str, Any]) -> jax.Array:
        """A send now goes in ``downcast`` (else in the cycling wire)."""
        return jnp.asarray(True) if not two_wires else c["global_skip"] < 1

    def decide(c: Mapping[str, Any], plan: BatchPlan, G: int) -> Choices:
        """The general program's choices, traced (``G``: replicas per node)."""
        return Choices(
            local_sync=c["local_sync_next"] & (G > 1),  # a node of one averages nothing
            send=jnp.where(plan.sync, jnp.where(sends_low(c), 1, 2 if two_wires else 1), 0),
            merge=jnp.where(plan.merge, 1, jnp.where(plan.broadcast_previous, 2, 0)),
            blocking=plan.blocking,
            last=c["batch_in_epoch"] == last_batch,
        )

    def next_control(c: Mapping[str, Any], choices: Choices, plan: BatchPlan, cycle: tuple, G: int) -> dict:
        """The control values after this batch (``c``: before it; ``cycle``: ``(gs, ls, btw)``
        if the epoch ends; ``G``: replicas per node)."""
        sync, b, group = choices.send != 0, c["batch_in_epoch"], c["send_group"]
        was_valid = _pick(choices.merge == 1, False, c["pending_valid"])
        return {
            "batch_in_epoch": _i32(_pick(choices.last, 0, b + 1)),
            **{k: _i32(_pick(choices.last, new, c[k])) for k, new in zip(CYCLE, cycle)},
            "send_group": _i32(_pick(sync, _pick(choices.last, 0, (group + 1) % G), group)),
            "previous_send_group": _i32(
                _pick(sync, _pick(choices.blocking, NO_GROUP, group), c["previous_send_group"])
            ),
            "pending_valid": _flag(_pick(sync, _pick(choices.blocking, False, True), was_valid)),
            "local_sync_next": plan.local_sync_next,
        }

    def schedule(
        control: tuple[jax.Array, ...], G: int
    ) -> tuple[jax.Array, tuple[jax.Array, ...], jax.Array]:
        """``Schedule.plan``: the branch of this batch (-1 at the epoch's end, whose cycle comes
        from the loss), and the control values after it."""
        c = {k: v != 0 if k in FLAGS else v for k, v in zip(CONTROL, control)}
        plan = plan_of(c)
        choices = decide(c, plan, G)
        after = next_control(c, choices, plan, tuple(c[k] for k in CYCLE), G)
        branch = jnp.where(choices.last, -1, choices.code())
        return branch, tuple(after[k] for k in CONTROL), ~choices.last

    def when(pred, fn, operand):
        if isinstance(pred, bool):  # a program of one branch
            return vary(fn(operand) if pred else operand)
        return jax.lax.cond(pred, lambda o: vary(fn(o)), vary, operand)

    def switch(index, fns, operand):
        if isinstance(index, int):
            return vary(fns[index](operand))
        return jax.lax.switch(index, [lambda o, f=f: vary(f(o)) for f in fns], operand)

    def update_fn(updates, state, params=None, *, value=None, **extra):
        check_state("daso", state, DasoState)
        if params is None:
            raise ValueError("daso needs params: call update(updates, state, params, value=loss)")
        G, N = local_comm.size, cross_comm.size
        # The replicated control state, seen as uniform so that every cond/switch below stays a
        # branch under simulate (see Communicator.uniform).
        replicated = (
            "batch_in_epoch", "epoch", "global_skip", "local_skip", "batches_to_wait", "send_group",
            "previous_send_group", "pending_wait", "pending_sent_batch", "pending_valid",
            "pending_low_precision", "local_sync_next", "plateau_bad_epochs",
        )  # fmt: skip
        uniform = cross_comm.uniform(local_comm.uniform({k: getattr(state, k) for k in replicated}))
        s = state._replace(**uniform)
        b = s.batch_in_epoch
        control = s._asdict()
        plan, send_low = plan_of(control), sends_low(control)
        delay = b - s.pending_sent_batch
        # with one batch per epoch every batch ends one: the general program runs them all
        position, branch = next_update() if last_batch > 0 else (0, None)
        if branch is None:  # the general program: conditionals on the traced choices
            choices, before = decide(control, plan, G), s
        else:  # a harness's program of one branch (``local_program``): the choices are known, and
            # a field this batch leaves alone is returned as the state holds it, not computed
            choices, before = Choices.of(branch), state

        # ---- 1. intra-node gradient averaging (decided by the previous step) ----
        def average_grads(operand):
            g, led = operand
            return local_comm.pmean(g), led.record(kind_name("all_reduce", g, scope="local"))

        ledger = s.daso_ledger
        if G > 1:
            updates, ledger = when(choices.local_sync, average_grads, (updates, ledger))

        # ---- 2. local step ----
        if value is not None:
            extra = extra | {"value": value}
        local_updates, inner_state = local_step(
            inner,
            updates,
            s.inner_state,
            params,
            nonfinite=nonfinite,
            uniform=lambda x: cross_comm.uniform(local_comm.uniform(x)),
            vary=vary,
            recompute=not branch,  # a local step alone (branch 0; None: the general program, no selects)
            **extra,
        )
        # materialized in the parameters' dtype, as the general program's conditionals do: a
        # program of one branch may otherwise send bfloat16 parameters unrounded (excess precision)
        local = jax.lax.optimization_barrier(
            jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, local_updates)
        )

        # ---- 3. send: every group all-reduces over cross_comm; group send_group keeps it ----
        def send(wire):
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
                    summed = cross_comm.psum(packed, dtype=wire)
                    led = led.record(kind_name("all_reduce", params, wire, scope="cross"))
                else:  # a group of one sends nothing: the "sum" is the value rounded to the wire
                    summed = jax.tree.map(
                        lambda x: x if wire is None else x.astype(wire).astype(x.dtype), packed
                    )
                return jax.tree.map(lambda x: x.astype(_storage_dtype(x.dtype)), summed), led

            return branch

        sends = [lambda o: o, send(low)] + ([send(cycle_wire)] if two_wires else [])
        sent, ledger = switch(choices.send, sends, (before.pending_sum, ledger))

        # ---- 4. merge the older pending send, broadcast within the node ----
        def broadcast_from(tree, root, led):
            if G == 1:
                return tree, led
            return local_comm.broadcast(tree, root), led.record(kind_name("broadcast", params, scope="local"))

        def divide(total, denom, is_low, p):
            """``total / denom`` in the send's wire dtype (Heat divides in the buffer dtype)."""

            def in_wire(wire):
                w = p.dtype if wire is None else wire
                return (total.astype(w) / denom.astype(w)).astype(p.dtype)

            return jnp.where(is_low, in_wire(low), in_wire(cycle_wire)) if two_wires else in_wire(low)

        def merge_then_broadcast(operand):
            p, led = operand
            if quirks.stored_merge_weight:
                numer = jnp.where(s.pending_wait > 0, 2 * s.pending_wait, 1)
            else:
                numer = 2 * delay
            denom = (numer + N).astype(jnp.float32)
            factor = numer.astype(jnp.float32) / denom
            merged = jax.tree.map(
                lambda x, tot: x * factor.astype(x.dtype) + divide(tot, denom, s.pending_low_precision, x),
                p,
                s.pending_sum,
            )
            return broadcast_from(merged, s.previous_send_group, led)

        target, ledger = switch(
            choices.merge,
            [lambda o: o, merge_then_broadcast, lambda o: broadcast_from(o[0], s.previous_send_group, o[1])],
            (local, ledger),
        )

        # ---- 5. blocking average of the send just made, broadcast within the node ----
        def average_then_broadcast(operand):
            p, led, summed = operand
            n = jnp.asarray(N, jnp.float32)
            averaged, led = broadcast_from(
                jax.tree.map(lambda x, tot: divide(tot, n, send_low, x), p, summed), s.send_group, led
            )
            # nothing is left pending: the pending sum stays as it was (read only while
            # pending_valid), so a program of this branch alone neither reads nor writes it
            return averaged, led, before.pending_sum

        target, ledger, pending_sum = when(choices.blocking, average_then_broadcast, (target, ledger, sent))

        # ---- 6. epoch end: mean loss over all replicas, plateau detector, next (gs, ls, btw) ----
        loss_sum, loss_count = before.epoch_loss_sum, before.epoch_loss_count
        if value is not None:
            loss_sum = s.epoch_loss_sum + jnp.mean(jnp.asarray(value).astype(jnp.float32))
            loss_count = s.epoch_loss_count + 1

        def reduce_loss(led):
            both = cross_comm.psum(local_comm.psum(jnp.stack([loss_sum, loss_count.astype(jnp.float32)])))
            mean = both[0] / jnp.maximum(both[1], 1.0)
            best = s.best_epoch_loss
            improved = jnp.where(
                best >= 0, mean < best * (1 - stability_level), mean < best * (1 + stability_level)
            ) & (both[1] > 0)
            # Make the decision bit-identical everywhere (it gates later collectives).
            improved = cross_comm.agree(local_comm.agree(improved, op="all"), op="all")
            for group, loss_kind, agree_kind in zip((G, N), LOSS_KINDS, AGREE_KINDS):
                if group > 1:
                    led = led.record(loss_kind).record(agree_kind)
            return mean, both[1] > 0, improved, led

        def no_loss(led):
            return jnp.asarray(jnp.nan, jnp.float32), jnp.asarray(False), jnp.asarray(False), led

        if branch is None:
            mean_loss, have_loss, improved, ledger = jax.lax.cond(choices.last, reduce_loss, no_loss, ledger)
        else:  # a program of one branch never ends an epoch
            mean_loss, have_loss, improved, ledger = no_loss(ledger)
        new_epoch = _pick(choices.last, s.epoch + 1, before.epoch)
        cycle, bad, record_loss = next_cycle(
            new_epoch,
            (s.global_skip, s.local_skip, s.batches_to_wait),
            s.plateau_bad_epochs,
            improved=improved,
            have_loss=have_loss,
            rules=rules,
        )

        # ---- bookkeeping of the global sync ----
        sync = choices.send != 0
        nonblocking_send = _pick(sync, _pick(choices.blocking, False, True), False)
        merged = choices.merge == 1
        events = DasoEvents(
            local_grad_sync=_flag(before.local_sync_next),
            sent_group=_i32(_pick(sync, s.send_group, NO_GROUP)),
            sent_wait=_i32(_pick(sync, plan.wait, 0)),
            sent_low_precision=_flag(_pick(sync, send_low, False)),
            merged_group=_i32(_pick(merged, s.previous_send_group, NO_GROUP)),
            merged_wait=_i32(_pick(merged, s.pending_wait, 0)),
            merged_delay=_i32(_pick(merged, delay, 0)),
            merge_broadcast_root=_i32(_pick((choices.merge != 0) & (G > 1), s.previous_send_group, NO_GROUP)),
            averaged_group=_i32(_pick(choices.blocking, s.send_group, NO_GROUP)),
            ended_epoch=_flag(choices.last),
        )
        moved = choices.blocking | (choices.merge != 0)  # a merge or an average set the parameters

        def update(t, p, u):
            """``t − p``; in a program of one kind of batch where only the local step moved the
            parameters, that step's own update ``u``: ``p + ((p + u) − p)`` is ``p + u`` unless
            the subtraction rounds, and computing it made XLA copy the donated parameters."""
            if branch is not None and not moved and u.dtype == p.dtype:
                return u
            return (t - p).astype(p.dtype)

        out = jax.tree.map(update, target, params, local_updates)
        agreed = state.agreed
        if exact_sync:  # a merge or blocking average broadcast within the node: the node agrees
            bits = jax.tree.map(as_bits, target)  # the broadcast's own result (it sums them)
            if branch is None:
                agreed = record_agreed(agreed, bits, jnp.asarray(moved), vary)
            else:
                flags = [AGREED if moved else UNTOUCHED] * len(jax.tree.leaves(params))
                fresh_tree = jax.tree.unflatten(jax.tree.structure(params), flags)
                agreed = record_agreed(agreed, bits, fresh_tree, vary)
                mark_flags(agreed.fresh, flags)
        new_state = DasoState(
            **next_control(before._asdict(), choices, plan, cycle, G),
            epoch=new_epoch,
            pending_sum=pending_sum,  # through the blocking cond: a tree-wide select would run every call
            pending_wait=_i32(_pick(nonblocking_send, plan.wait, before.pending_wait)),
            pending_sent_batch=_i32(_pick(nonblocking_send, b, before.pending_sent_batch)),
            pending_low_precision=_flag(_pick(nonblocking_send, send_low, before.pending_low_precision)),
            epoch_loss_sum=_pick(choices.last, jnp.float32(0), loss_sum).astype(jnp.float32),
            epoch_loss_count=_i32(_pick(choices.last, 0, loss_count)),
            best_epoch_loss=_pick(
                choices.last, _pick(record_loss, mean_loss, before.best_epoch_loss), before.best_epoch_loss
            ).astype(jnp.float32),
            plateau_bad_epochs=_i32(_pick(choices.last, bad, before.plateau_bad_epochs)),
            last_events=events,
            inner_state=inner_state,
            daso_ledger=ledger,
            agreed=agreed,
        )
        if last_batch > 0:
            record(
                Schedule(
                    tuple(getattr(state, k) for k in CONTROL),
                    tuple(getattr(new_state, k) for k in CONTROL),
                    functools.partial(schedule, G=G),
                    position,
                )
            )
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
