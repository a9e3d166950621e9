"""The periodic-synchronization engine: a local step, then a synchronization on a static schedule.

Local SGD, DiLoCo, SlowMo, partial averaging and Streaming DiLoCo are each one call of
``periodic``: what differs between them is the *schedule* (which synchronization, if any, follows
the local step of update ``t``) and the *synchronizations* themselves (a mean of the parameters, an
outer optimizer step on the averaged displacement, the same on one fragment of the parameters...).
Everything else exists once, here, for all of them:

* the step counter, seen as replica-uniform (``Communicator.uniform``) so that the schedule's
  ``lax.switch`` stays a branch under ``simulate`` as it is on a mesh and under MPI;
* the local step of ``inner`` under the non-finite policy (``nonfinite=``);
* the warm-up (``warmup_steps``: gradients all-reduced before the local step, no synchronization);
* the start check (``check_start``) and a synchronization's ``begin`` hook (anchors taken when the
  warm-up ends), both in a branch of the same switch that runs on one step only;
* ``updates = new parameters − parameters``, and marking the branches' outputs per replica.

A synchronization is a function ``SyncInput → SyncInput`` that replaces ``local`` (the parameters
after this replica's local step) by the parameters every replica continues from, and updates its
own state and the ledger. It may call the communicator; it runs only on the steps the schedule
gives it. ``docs/architecture.md`` builds an algorithm on it in one file.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_bools
from optaxdist.accounting import CommLedger, Kind, kind_name, payload_bytes, per_replica
from optaxdist.comm.base import Communicator, as_bits, canonical_comm_dtype
from optaxdist.transforms._checks import (
    check_comm,
    check_nonfinite,
    check_state,
    check_transformation,
    check_warmup_steps,
    find_states,
    local_step,
)
from optaxdist.transforms._start import check_identical_start, start_kinds
from optaxdist.transforms.local_program import Schedule, mark_flags, next_update, record

UNTOUCHED, AGREED, CHANGED = 0, 1, 2  # what the last update's synchronization did to a leaf


class AgreedParams(NamedTuple):
    """What the last update's synchronization did to each parameter leaf (``exact_sync``), and
    the values it agreed on, so that ``optaxdist.sync_params`` can give every replica exactly
    those bits: ``params + (target − params)`` is not ``target`` in floating point once the
    replicas have drifted apart.

    Attributes:
      fresh: a tree of the parameters' structure, per leaf an int8 (replicated): ``AGREED`` (1)
        set to a value every replica of the group holds, ``CHANGED`` (2) changed to a
        per-replica value (a gossip mix, a blended merge), ``UNTOUCHED`` (0) only the local step.
      values: the agreed values, in the parameters' dtypes (a tree of their structure), or as
        their bit patterns (integers of the same width) where the agreement is a broadcast
        (DASO's in node: ``Communicator.broadcast`` sums bit patterns, so the state keeps the
        broadcast's own result, and the parameters' values are a second buffer, not a third);
        None where the synchronizations' state holds them (``sync_state.anchor_params(like)``: the
        anchors of DiLoCo, SlowMo and Streaming DiLoCo); ``()`` where the synchronizations never
        agree (gossip without a global average, a blended merge): flags only.
    """

    fresh: Any
    values: Any

    def leaves(self, like: list, held: Any = None) -> tuple[list, list]:
        """``(fresh, values)`` as lists aligned with ``like`` (parameter leaves), the values in
        their dtypes (bit patterns reinterpreted); ``held``: the values when the state does not
        keep them."""
        if _never(self.values):  # no leaf is ever AGREED: the values are not read
            return jax.tree.leaves(self.fresh), list(like)
        values = jax.tree.leaves(self.values if self.values is not None else held)
        return jax.tree.leaves(self.fresh), [_from_kept(v, p.dtype) for v, p in zip(values, like)]


def _from_kept(kept: jax.Array, dtype: Any) -> jax.Array:
    """A kept value in the parameter's ``dtype``: bit patterns reinterpreted (an integer kept for
    a float parameter: only ``"bits"`` keeps one), else a cast."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.issubdtype(kept.dtype, jnp.integer):
        return jax.lax.bitcast_convert_type(kept, dtype)
    return kept.astype(dtype)


def _never(values: Any) -> bool:
    """``AgreedParams.values`` of synchronizations that never agree (``()``)."""
    return isinstance(values, tuple) and not values


def initial_agreed(params: Any, vary: Callable[[Any], Any], values: str = "copy") -> AgreedParams:
    """Nothing agreed yet. ``values``: ``"copy"`` (copies of ``params``, marked per replica by
    ``vary``, fill the buffer), ``"bits"`` (the same, float leaves as their bit patterns, for
    agreements made by a broadcast: see ``AgreedParams.values``), ``"anchors"`` (None) or
    ``"never"`` (``()``)."""
    if values in ("copy", "bits"):
        keep = as_bits if values == "bits" else lambda p: p
        kept = vary(jax.tree.map(lambda p: keep(jnp.array(p, copy=True)), params))
    else:
        kept = None if values == "anchors" else ()
    return AgreedParams(jax.tree.map(lambda _: jnp.int8(UNTOUCHED), params), kept)


def record_agreed(agreed: AgreedParams, target: Any, fresh: Any, vary: Callable[[Any], Any]) -> AgreedParams:
    """``agreed`` after an update whose synchronization left ``target`` (for a state made with
    ``"bits"``, its bit patterns: ``as_bits``). ``fresh``: per leaf a
    static ``UNTOUCHED`` / ``AGREED`` / ``CHANGED`` (the periodic engine), or one replicated bool
    scalar, True when every leaf was agreed (DASO; a ``lax.cond``). ``vary`` marks the values per
    replica."""
    dynamic = isinstance(fresh, jax.Array)
    if dynamic:
        flags = jax.tree.map(lambda _: jnp.where(fresh, AGREED, UNTOUCHED).astype(jnp.int8), agreed.fresh)
    else:
        flags = jax.tree.map(jnp.int8, fresh)
    if agreed.values is None or _never(agreed.values):
        return AgreedParams(flags, agreed.values)
    if dynamic:
        cast = lambda: jax.tree.map(lambda t, v: t.astype(v.dtype), target, agreed.values)  # noqa: E731
        values = jax.lax.cond(fresh, lambda: vary(cast()), lambda: vary(agreed.values))
    else:
        values = jax.tree.map(
            lambda f, t, v: t.astype(v.dtype) if f == AGREED else v, fresh, target, agreed.values
        )
    return AgreedParams(flags, vary(values))


class PeriodicState(NamedTuple):
    """State of every transform built on ``periodic``.

    Attributes:
      step: updates so far (int32, replicated).
      last_sync: the synchronization the last update ran (replicated): 0 none, ``k`` the
        schedule's ``k``-th (1-based); ``sync_model_state`` reads it.
      inner_state: the local optimizer's state (per replica).
      sync_state: the synchronizations' own state (anchors, outer optimizer state, residuals).
      ledger: what was sent (replicated; per replica with ``ledger_varies``, e.g. gossip).
      agreed: with ``exact_sync``, the parameters the last synchronization set
        (``AgreedParams``, read by ``optaxdist.sync_params``); ``()`` without.
    """

    step: jax.Array
    last_sync: jax.Array
    inner_state: optax.OptState
    sync_state: Any
    ledger: CommLedger
    agreed: AgreedParams | tuple[()] = ()

    def agreed_leaves(self, like: list) -> tuple[list, list]:
        """``AgreedParams.leaves`` for ``sync_params`` (``like``: the parameter leaves this state
        was made for), reading DiLoCo's anchors when the state keeps no copy."""
        held = self.sync_state.anchor_params(like) if self.agreed.values is None else None
        return self.agreed.leaves(like, held)


class SyncInput(NamedTuple):
    """What a synchronization sees, and (with ``local`` replaced) what it returns.

    Attributes:
      step: this update's 0-based index, warm-up included (replicated int32; the inner optimizer's
        step, which outer optimizers receive as ``inner_step``).
      params: the parameters before this update.
      update: the local step's update (``local = params + update``, rounded to the parameters'
        dtype).
      local: the parameters after this replica's local step; a synchronization replaces them by
        the parameters every replica continues from (in their dtype or wider: the engine returns
        ``local − params`` in the parameters' dtype).
      inner_state: the local optimizer's state after the local step.
      sync_state: the synchronizations' state.
      ledger: the ledger; record what is sent.
      agreed: the indices of the leaves of ``local`` the synchronization set to a value every
        replica of its group now holds (a mean, an outer step's anchor), for ``exact_sync``;
        leaves mixed with per-replica values (gossip, a blended merge) are not agreed.
    """

    step: jax.Array
    params: Any
    update: Any
    local: Any
    inner_state: Any
    sync_state: Any
    ledger: CommLedger
    agreed: tuple[int, ...] = ()


Sync = Callable[[SyncInput], SyncInput]


def every_leaf(tree: Any) -> tuple[int, ...]:
    """``SyncInput.agreed`` for a synchronization that agrees on all of ``tree``'s leaves."""
    return tuple(range(len(jax.tree.leaves(tree))))


def periodic(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator,
    name: str,
    schedule: Callable[[jax.Array, int], jax.Array],
    syncs: Sequence[Sync] | Callable[[Any], Sequence[Sync]],
    kinds: Callable[[Any, Any], dict[Kind, int]] = lambda params, inner_state: {},
    init_sync: Callable[[Any], Any] = lambda params: (),
    begin: Sync | None = None,
    background: Callable[[jax.Array, Any, Any, CommLedger], tuple[Any, CommLedger]] | None = None,
    warmup_steps: int = 0,
    dtype: Any = None,
    ledger_varies: bool = False,
    check_start: bool = True,
    nonfinite: str = "skip",
    exact_sync: bool = True,
    agreed_values: str = "copy",
    averages_inner_state: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Local steps of ``inner``; after the local step of update ``t``, synchronization
    ``syncs[k − 1]`` where ``k = schedule(t − warmup_steps, len(syncs)) ≥ 1``.

    Args:
      inner: the local optimizer.
      comm: all replicas (the start check, the warm-up's all-reduce, replica-uniform counters).
      name: the transform's name, for error messages.
      schedule: ``(step, number of syncs) → index``: maps the step counted from the end of the
        warm-up (a replicated int32) to the 1-based index of the synchronization that follows the
        local step, 0 for none. A pure function of the step: the same on every replica.
      syncs: the synchronizations (``SyncInput → SyncInput``), or a function of the parameters
        returning them (when their number depends on the parameters).
      kinds: ``(params, inner_state) → {ledger kind: payload bytes}``: what the synchronizations
        record. The warm-up's and the start check's kinds are added here.
      init_sync: ``params → sync_state``.
      begin: run once, on the first step after the warm-up, after the local step and before that
        step's synchronization (e.g. taking the anchors from the parameters). It may change the
        synchronizations' state and the ledger, not ``local``.
      background: ``(step counted from the end of the warm-up, params, sync_state, ledger) →
        (sync_state, ledger)``, run on every update before the schedule's switch. It never sees
        this step's gradients (nor the local step), so the compiler may run its collectives while
        the step computes them: a collective that a synchronization started and a later one
        finishes, overlapped with computation (``params``: for their shapes and dtypes). It picks
        its own steps without a conditional (selects and dynamic slices on the replicated step):
        XLA runs a collective alongside other work only outside one.
      warmup_steps: updates whose gradients are all-reduced (over ``comm``, in ``dtype``) before
        the local step, with no synchronization: replicas stay identical (post-local SGD).
      ledger_varies: the synchronizations send different numbers of messages on different
        replicas (gossip on irregular graphs): the ledger is per replica, not replicated.
      dtype: wire dtype of the warm-up's all-reduce (None: the gradients' own dtype; the ledger
        counts the parameters' bytes in it).
      check_start: on the first update, raise ``ValueError`` on every replica if their parameters
        differ (fingerprints compared: ``4·leaves + 4`` bytes, ledger ``broadcast[start check]``).
      nonfinite: ``"skip"``: a local step whose update is not finite (with
        ``averages_inner_state``, or whose new inner state is not) is not taken on this replica
        (zero update, inner state kept, nothing sent: a non-finite gradient never reaches any
        replica's state, and no average carries a non-finite value to another replica); it costs
        one reading pass over what it checks, and a select of the update and the state in a
        ``lax.cond`` taken only when some replica is not finite (see ``local_step``).
        ``"ignore"``: no check, no cost, for inner optimizers that guard themselves
        (``dynamic_loss_scale``, ``optax.apply_if_finite``).
      exact_sync: keep what each synchronization agreed on (``SyncInput.agreed``) in the state
        (``PeriodicState.agreed``: one copy of the parameters, and a flag per leaf), so that
        ``optaxdist.apply_updates`` / ``sync_params`` leave every replica holding exactly those
        bits. False: no copy; ``optax.apply_updates`` leaves the replicas within a rounding of
        each other.
      agreed_values: where ``exact_sync`` finds the agreed values: ``"copy"`` (the engine keeps
        one), ``"anchors"`` (the synchronizations' state holds them whole, its
        ``anchor_params(like)``: DiLoCo's anchors; flags only) or ``"never"`` (the
        synchronizations never agree, e.g. gossip without a global average: flags only, which
        still tell ``sync_params`` which leaves a synchronization changed).
      averages_inner_state: the synchronizations average the inner optimizer's state (DES-LOC,
        ``local_sgd(average_inner_state=True)``): ``nonfinite="skip"`` then also checks the new
        state's arrays, so that a finite gradient that overflows a moment on one replica (Adam's
        second moment, whose overflow leaves the update finite) is not averaged into every replica.

    The schedule's synchronizations, the warm-up and the first step after it are branches of one
    ``lax.switch`` on the replicated step (``comm.uniform``): a local step runs only the local
    step, on every harness. A harness made with ``split_local_steps=True`` also traces the step
    with the local step alone, and with the local step and each synchronization
    (``optaxdist.transforms.local_program``), and runs on each step the program of the branch
    ``Schedule.plan`` gives it: no switch, so the update fuses with what follows.
    """
    check_transformation("inner", inner)
    warmup_steps = check_warmup_steps(warmup_steps)
    check_comm("comm", comm)
    check_nonfinite(nonfinite)
    check_bools(check_start=check_start, exact_sync=exact_sync, averages_inner_state=averages_inner_state)
    if agreed_values not in ("copy", "anchors", "never"):
        raise ValueError(f"agreed_values={agreed_values!r} must be 'copy', 'anchors' or 'never'")
    wire = canonical_comm_dtype(dtype)
    inner = optax.with_extra_args_support(inner)

    def all_kinds(params, inner_state) -> dict[Kind, int]:
        out = dict(kinds(params, inner_state))
        if warmup_steps:
            out[kind_name("all_reduce", params, wire)] = payload_bytes(params, wire)
        return out | start_kinds(check_start, params)

    def vary(tree):
        return per_replica(tree, comm)

    def init_fn(params):
        inner_state = per_replica(inner.init(params), comm)
        ledger = CommLedger.create(all_kinds(params, inner_state))
        return PeriodicState(
            step=jnp.zeros((), jnp.int32),
            last_sync=jnp.zeros((), jnp.int32),
            inner_state=inner_state,
            sync_state=per_replica(init_sync(params), comm),
            ledger=comm.varying(ledger) if ledger_varies else ledger,
            agreed=initial_agreed(params, vary, agreed_values) if exact_sync else (),
        )

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError(f"{name} needs params: call update(updates, state, params)")
        check_state(name, state, PeriodicState)
        declared = tuple(all_kinds(params, state.inner_state))
        if state.ledger.kinds != declared:
            raise ValueError(
                f"{name}.update: the state's ledger counts {list(state.ledger.kinds)}, but {name} as "
                f"configured sends {list(declared)}: a state made by another transform or configuration, "
                "or for parameters of other dtypes"
            )
        bodies = tuple(syncs(params) if callable(syncs) else syncs)
        t = comm.uniform(state.step)  # keeps the switch a branch under simulate
        s = t - warmup_steps
        position, branch = next_update()  # a harness's program of one branch: no switch
        sync_state, ledger = state.sync_state, state.ledger
        if background is not None:  # before the switch, on state only: free to overlap
            sync_state, ledger = background(s, params, sync_state, ledger)

        def local(operand, then: Sync | None = None, *, moves_params: bool = True):
            """The local step, then ``then`` (a synchronization, or ``begin`` followed by one).
            Without one, or when it leaves the parameters alone, the update is the local step's."""
            grads, inner_state, sync_state, ledger, agreed = operand
            # inside each branch, not before the switch: a conditional of its own that reads the
            # parameters makes XLA copy donated parameters on every step
            ledger = check_identical_start(check_start and branch is None, params, t, ledger, comm)
            u, inner_state = local_step(
                inner,
                grads,
                inner_state,
                params,
                nonfinite=nonfinite,
                uniform=comm.uniform,
                vary=vary,
                check_state=averages_inner_state,
                recompute=then is None,
                **extra,
            )
            treedef = jax.tree.structure(params)
            target, flags = params, [UNTOUCHED] * treedef.num_leaves
            if then is not None:
                local_params = optax.apply_updates(params, u)
                x = then(SyncInput(t, params, u, local_params, inner_state, sync_state, ledger))
                inner_state, sync_state, ledger = x.inner_state, x.sync_state, x.ledger
                # a synchronization that returns ``local`` itself (it averaged optimizer state
                # only) leaves the local step's update as it was, not ``(params + u) − params``
                if moves_params and x.local is not local_params:
                    u = jax.tree.map(lambda n, p: (n - p.astype(n.dtype)).astype(p.dtype), x.local, params)
                    # a leaf the synchronization returned as it got it is untouched (static)
                    before, after = jax.tree.leaves(local_params), jax.tree.leaves(x.local)
                    target = x.local
                    flags = [
                        AGREED if i in x.agreed else UNTOUCHED if a is b else CHANGED
                        for i, (b, a) in enumerate(zip(before, after))
                    ]
            if exact_sync:  # the flags are replicated, the values per replica
                agreed = record_agreed(agreed, target, jax.tree.unflatten(treedef, flags), vary)
                mark_flags(agreed.fresh, flags)  # in a program of one branch: no select in sync_params
            return (*per_replica((u, inner_state, sync_state, ledger), comm), agreed)

        def warm_up(operand):
            grads, inner_state, sync_state, ledger, agreed = operand
            grads = comm.pmean(grads, dtype=wire)
            ledger = ledger.record(kind_name("all_reduce", params, wire))
            return local((grads, inner_state, sync_state, ledger, agreed))

        num_syncs = len(bodies)

        def plan_at(control: tuple[jax.Array]) -> tuple[jax.Array, tuple[jax.Array], jax.Array]:
            """``Schedule.plan``: at this step, the schedule's synchronization (0: none), where
            the local step and it are all the update runs, else -1 (the start check, the
            warm-up, where ``begin`` runs, and where the schedule gives no synchronization's
            index: the switch's clamping decides there); the next step, known beforehand."""
            (counter,) = control
            index = schedule(counter - warmup_steps, num_syncs)
            alone = (counter >= warmup_steps) & (index >= 0) & (index <= num_syncs)
            if begin is not None:
                alone &= counter != warmup_steps
            if check_start:
                alone &= counter != 0
            branch = jnp.where(alone, index, -1).astype(jnp.int32)
            return branch, (optax.safe_increment(counter),), jnp.asarray(True)

        operand = (updates, state.inner_state, sync_state, ledger, state.agreed)
        if branch is not None:  # the harness runs this program only where ``plan_at`` gives it
            then = bodies[branch - 1] if branch else None
            out, inner_state, sync_state, ledger, agreed = local(operand, then)
            last_sync = jnp.asarray(branch, jnp.int32)
        else:
            # one switch: [local step, syncs..., warm-up, begin then (nothing, syncs...)]
            scheduled = schedule(s, len(bodies))
            branches = [local, *(lambda op, f=f: local(op, f) for f in bodies)]
            index = scheduled
            if warmup_steps:
                branches.append(warm_up)
                index = jnp.where(t < warmup_steps, len(branches) - 1, index)
            if begin is not None:
                first = len(branches)
                branches.append(lambda op: local(op, begin, moves_params=False))
                branches += [lambda op, f=f: local(op, lambda x: f(begin(x))) for f in bodies]
                index = jnp.where(t == warmup_steps, first + scheduled, index)
            out, inner_state, sync_state, ledger, agreed = jax.lax.switch(index, branches, operand)
            last_sync = jnp.where(t < warmup_steps, 0, scheduled).astype(jnp.int32)
        new_state = PeriodicState(
            step=optax.safe_increment(t),
            last_sync=last_sync,
            inner_state=inner_state,
            sync_state=sync_state,
            ledger=ledger,
            agreed=agreed,
        )
        record(Schedule((state.step,), (new_state.step,), plan_at, position))
        return out, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def periodic_states(opt_state: Any) -> list[PeriodicState]:
    """The ``PeriodicState`` nodes of an optimizer state, outermost first."""
    return find_states(opt_state, PeriodicState)
