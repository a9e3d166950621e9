"""Shared by the transforms: hyperparameter checks, finite local steps, finding sub-states."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_int
from optaxdist.accounting import keep_ledgers
from optaxdist.comm.base import Communicator
from optaxdist.transforms.local_program import static_program


def find_states(tree: Any, cls: type | tuple[type, ...]) -> list:
    """Every node of type ``cls`` in a (nested) optimizer state, outermost first, those nested in
    another one included (``dynamic_loss_scale(daso(dynamic_loss_scale(...)))``)."""
    found = []

    def visit(x):
        if isinstance(x, cls):
            found.append(x)
        for node in jax.tree.leaves(x, is_leaf=lambda y: y is not x and isinstance(y, cls)):
            if isinstance(node, cls):
                visit(node)

    visit(tree)
    return found


def all_finite(tree) -> jax.Array:
    """True iff every floating-point element of ``tree`` is finite (other leaves count as finite).

    ``all(isfinite(x))`` per leaf. A sum per leaf (NaN or infinite iff an element is, unless
    the sum overflows) was used before. It costs less where the update is a step's only work, as
    XLA:CPU writes this one's boolean array out before reducing it. But where the update comes
    from a model's backward pass in the same program, XLA:CPU turned each sum into a library
    reduction whose constant operands it wrote out at the parameters' size: a guarded local step
    of an MLP at 512 × 10k replicas under ``simulate`` took 1.5–2.1× a plain step with sums and
    1.06–1.16× with this (``local_sgd``, the DiLoCo family and DASO; "The non-finite guard's
    check" in ``docs/benchmarks.md``).
    """
    checks = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(checks).all() if checks else jnp.asarray(True)


def state_stays_finite(new_state, old_state) -> jax.Array:
    """True iff every array of ``new_state`` is finite and no scalar turned non-finite (a scalar
    may be non-finite on purpose, as ``reduce_on_plateau``'s initial best value, ``inf``)."""
    pairs = list(zip(jax.tree.leaves(new_state), jax.tree.leaves(old_state)))
    arrays_ok = all_finite([new for new, _ in pairs if jnp.ndim(new)])
    became = [
        jnp.isfinite(old) & ~jnp.isfinite(new)
        for new, old in pairs
        if not jnp.ndim(new) and jnp.issubdtype(new.dtype, jnp.inexact)
    ]
    return arrays_ok & ~jnp.any(jnp.stack(became)) if became else arrays_ok


def check_float_leaves(tree, transform: str) -> None:
    """Raise ``ValueError`` naming the first leaf of ``tree`` that is not floating point."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(
                f"{transform} averages parameters: every leaf must be floating point, got "
                f"{jnp.result_type(x).name} at {jax.tree_util.keystr(path) or 'the root'}"
            )


def check_comm(name: str, comm: Any) -> Communicator:
    if not isinstance(comm, Communicator):
        raise TypeError(f"{name} must be an optaxdist Communicator, got {type(comm).__name__}")
    return comm


def check_state(transform: str, state: Any, kind: type) -> None:
    """``TypeError`` unless ``state`` is the ``kind`` of state ``transform``'s ``init`` returns (not
    another transform's, nor a whole chain's: ``optax.chain`` hands each its own part)."""
    if not isinstance(state, kind):
        raise TypeError(
            f"{transform}.update: got a state of type {type(state).__name__}, not the "
            f"{kind.__name__} {transform}.init returns"
        )


def check_transformation(name: str, value: Any) -> Any:
    """``TypeError`` unless ``value`` is an optax gradient transformation (``init`` and ``update``)."""
    if not (callable(getattr(value, "init", None)) and callable(getattr(value, "update", None))):
        raise TypeError(f"{name} must be an optax.GradientTransformation, got {value!r}")
    return value


def check_number(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    open_low: bool = False,
    open_high: bool = False,
) -> float:
    """``value`` must be a real number (a Python or NumPy scalar, not a bool or a string) between
    ``low`` and ``high``, each end included unless ``open_*`` says otherwise."""
    try:
        number = float(value) if not isinstance(value, (bool, str, bytes)) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    above = low < number if open_low else low <= number
    below = number < high if open_high else number <= high
    if not (above and below):
        if math.isinf(high) and not open_high:
            allowed = f"{'>' if open_low else '≥'} {low}"
        elif math.isinf(high):
            allowed = f"{'>' if open_low else '≥'} {low} and finite"
        else:
            allowed = f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        raise ValueError(f"{name}={value!r} must be {allowed}")
    return number


def check_warmup_steps(warmup_steps: object) -> int:
    """Validate ``warmup_steps=`` (every transform's warm-up: exact all-reduce steps before the
    algorithm starts, counted from the first update)."""
    return check_int("warmup_steps", warmup_steps)


NONFINITE_POLICIES = ("skip", "ignore")


def check_nonfinite(nonfinite: str) -> None:
    """Validate a ``nonfinite=`` policy at construction."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r}; allowed: {NONFINITE_POLICIES}")


def _runs_alone(inner: optax.GradientTransformationExtraArgs, *args: Any) -> bool:
    """Whether ``inner.update(*args[:3], **args[3])`` has no effect and no collective (a
    primitive naming a mapped axis), so that running it twice costs no communication."""
    updates, state, params, extra = args
    avals = jax.tree.map(jax.typeof, (updates, state, params, extra))
    structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type), avals)
    try:
        traced = jax.make_jaxpr(lambda u, s, p, e: inner.update(u, s, p, **e))(*structs)
    except Exception:  # noqa: BLE001 (anything it cannot trace alone runs once)
        return False
    return not traced.effects and not _names_an_axis(traced.jaxpr)


def _names_an_axis(jaxpr: Any) -> bool:
    """A primitive of ``jaxpr`` (or of a jaxpr in its parameters) takes a named axis."""
    for eqn in jaxpr.eqns:
        for key in ("axis_name", "axes"):
            names = eqn.params.get(key)
            if any(isinstance(n, str) for n in (names if isinstance(names, tuple) else (names,))):
                return True
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns") and _names_an_axis(sub):
                    return True
    return False


def local_step(
    inner: optax.GradientTransformationExtraArgs,
    updates,
    inner_state,
    params,
    *,
    nonfinite: str,
    uniform: Callable[[Any], Any],
    vary: Callable[[Any], Any],
    check_state: bool = False,
    recompute: bool = True,
    **extra,
) -> tuple[optax.Updates, optax.OptState]:
    """``inner.update`` on this replica, under a non-finite policy (``nonfinite=``):

    * ``"skip"`` (the default of every local-step transform): when the inner update has a
      non-finite element (as it does when a plain optimizer is given a non-finite gradient), no
      step at all on this replica: zero updates, ``inner_state`` kept. The decision is local:
      nothing is sent, and since the non-finite values never enter this replica's parameters or
      state, no later average carries them to another replica. With ``check_state`` (transforms
      that average the inner state: DES-LOC, ``average_inner_state``) the arrays of the new state
      are checked too: a finite but huge gradient can overflow Adam's second moment while the
      update stays finite (``mu / sqrt(inf) = 0``), and the next moment average would carry the
      ``inf`` to every replica. A scalar of the state counts only when it turns non-finite on
      this step (an inner optimizer may keep one non-finite on purpose:
      ``optax.contrib.reduce_on_plateau``'s initial best value; a scalar parameter's moment is a
      scalar too). Without ``check_state`` such an overflow stays in this replica's own state
      (the moment's coordinate stops moving there) and no average carries it on. An inner
      that handles non-finite gradients itself (``dynamic_loss_scale``: zero updates, scale
      backed off) keeps its new state. Ledgers in the inner state keep counting (an inner
      collective that ran still sent its bytes). Cost: one reading pass over the update (and the
      state's arrays; see ``all_finite``); the select of the update and the inner
      state runs in a ``lax.cond`` only on a step where some replica is not finite. In the
      programs of fixed branches of ``split_local_steps``: selects on every step, and, with
      ``recompute`` (a local step that nothing follows: no synchronization reads the update),
      the update is computed a second time instead of written and read back (unless the inner
      update communicates), so the check reads the gradients and the state once more.
    * ``"ignore"``: ``inner.update`` as it is, at no cost: for inner optimizers that guard
      themselves (``dynamic_loss_scale``, ``optax.apply_if_finite``) or runs that accept that a
      non-finite gradient poisons the average.

    ``uniform`` is the transform's ``Communicator.uniform`` over all replicas (it makes "some
    replica under ``simulate`` is not finite" one predicate, so that the ``cond`` stays a branch)
    and ``vary`` marks per-replica values (``per_replica``: both branches have the same types).
    """
    new_updates, new_state = inner.update(updates, inner_state, params, **extra)
    if nonfinite == "ignore":
        return new_updates, new_state
    ok = all_finite(new_updates)
    if check_state:
        ok &= state_stays_finite(new_state, inner_state)

    def skip_where_not_finite(_):
        skipped = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, inner_state)
        return vary(skipped), vary(keep_ledgers(kept, new_state))

    if static_program():
        # a harness's program of fixed branches: selects, which fuse with what reads the update and
        # the state, where a conditional is a pass of its own (on a GPU, a read of its predicate
        # on the host). The update is computed a second time, from inputs the sums cannot share:
        # XLA then reads the inputs for the sums without writing the update to memory, and the
        # step writes what a plain step writes. Not where that would run a collective twice, nor
        # before a synchronization, which writes the update anyway (there the recomputation kept
        # more scratch: D-PSGD's sync at 64 × 100k took 12,078 page faults per call on the CPU
        # against 798, and local_sgd's, D-PSGD's and SGP's cost 10-20 % more: docs/benchmarks.md).
        if recompute and _runs_alone(inner, updates, inner_state, params, extra):
            again = jax.lax.optimization_barrier((updates, inner_state, params, ok))
            updates, inner_state, params, ok = again
            new_updates, new_state = inner.update(updates, inner_state, params, **extra)
        return skip_where_not_finite(None)
    # ``uniform(~ok)``: some replica of this program is not finite (under simulate any of the
    # vmapped ones, elsewhere this one); only then do the per-replica selects run
    return jax.lax.cond(
        uniform(~ok), skip_where_not_finite, lambda _: (vary(new_updates), vary(new_state)), None
    )
