"""Shared by the transforms: hyperparameter checks, finite local steps, finding sub-states."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from optaxdist.accounting import keep_ledgers


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
    """True iff every floating-point element of ``tree`` is finite (other leaves count as finite)."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def check_sgd_hyperparameters(
    *, momentum: float, dampening: float, weight_decay: float, nesterov: bool
) -> None:
    """torch.optim.SGD's rules: momentum ≥ 0, weight_decay ≥ 0, nesterov needs momentum > 0 and
    no dampening."""
    if momentum < 0:
        raise ValueError(f"momentum={momentum!r} must be ≥ 0")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be ≥ 0")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")


def check_float_leaves(tree, transform: str) -> None:
    """Raise ``ValueError`` naming the first leaf of ``tree`` that is not floating point."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(
                f"{transform} averages parameters: every leaf must be floating point, got "
                f"{jnp.result_type(x).name} at {jax.tree_util.keystr(path) or 'the root'}"
            )


def check_warmup_steps(warmup_steps: object) -> int:
    """Validate ``warmup_steps=`` (every transform's warm-up: exact all-reduce steps before the
    algorithm starts, counted from the first update)."""
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} must be an int ≥ 0")
    return warmup_steps


NONFINITE_POLICIES = ("skip", "ignore")


def check_nonfinite(nonfinite: str) -> None:
    """Validate a ``nonfinite=`` policy at construction."""
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r}; allowed: {NONFINITE_POLICIES}")


def local_step(
    inner: optax.GradientTransformationExtraArgs, updates, inner_state, params, *, nonfinite: str, **extra
) -> tuple[optax.Updates, optax.OptState]:
    """``inner.update`` on this replica, under a non-finite policy (``nonfinite=``):

    * ``"skip"`` (the default of every local-step transform): when the inner update has a
      non-finite element (as it does when a plain optimizer is given a non-finite gradient), no
      step at all on this replica: zero updates, ``inner_state`` kept. The decision is local:
      nothing is sent, and since the non-finite values never enter this replica's parameters or
      state, no later average carries them to another replica. Only the update is checked, so an
      inner that handles non-finite gradients itself (``dynamic_loss_scale``: zero updates, scale
      backed off) keeps its new state. Ledgers in the inner state keep counting (an inner
      collective that ran still sent its bytes). Cost: one pass over the update (``isfinite``
      reduction) and an element-wise select of the update and the inner state, fused by XLA
      into the step.
    * ``"ignore"``: ``inner.update`` as it is, at no cost: for inner optimizers that guard
      themselves (``dynamic_loss_scale``, ``optax.apply_if_finite``) or runs that accept that a
      non-finite gradient poisons the average.
    """
    new_updates, new_state = inner.update(updates, inner_state, params, **extra)
    if nonfinite == "ignore":
        return new_updates, new_state
    ok = all_finite(new_updates)
    new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
    kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, inner_state)
    return new_updates, keep_ledgers(kept, new_state)
