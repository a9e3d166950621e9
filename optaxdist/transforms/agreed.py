"""Bit-identical replicas after a synchronization: ``apply_updates`` and ``sync_params``.

A transform that replaces the parameters by a value every replica agrees on (an average, an outer
step's anchor) returns the update ``target − params``. In floating point ``params + (target −
params)`` is not ``target`` once the replicas have drifted apart (``1 + (1e-6 − 1) ≠ 1e-6`` in
float32), so ``optax.apply_updates`` leaves them within a rounding of each other, not equal. With
``exact_sync=True`` (the default of every synchronizing transform) the state keeps what the last
synchronization agreed on, and these two functions give every replica exactly those bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from optaxdist.transforms._checks import find_states
from optaxdist.transforms.daso import DasoState
from optaxdist.transforms.periodic import PeriodicState


def sync_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """``params`` (after ``optax.apply_updates``) with every leaf the last update synchronized set
    to the value the replicas agreed on, bit for bit.

    Call it on each replica after the update, with the optimizer state that update returned. On
    steps without a synchronization, and for states made with ``exact_sync=False``, it returns
    ``params`` unchanged. Cost: an element-wise select over the parameters (none on a mesh or under
    MPI on steps where nothing was synchronized: a ``lax.cond``). Transforms nested in one another
    are applied innermost first, so the outermost synchronization wins, as in the update.

    Example (Flax NNX, whose ``Optimizer.update`` calls ``optax.apply_updates``)::

        optimizer.update(model, grads)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, optaxdist.sync_params(params, optimizer.opt_state))
    """
    for state in reversed(find_states(opt_state, (PeriodicState, DasoState))):
        agreed = state.agreed_params(params)
        if agreed is None:
            continue
        # leaf by leaf: the state may wrap them differently (Flax NNX's OptVariable for Param)
        fresh, values = jax.tree.leaves(agreed[0]), jax.tree.leaves(agreed[1])
        leaves, treedef = jax.tree.flatten(params)
        if not fresh:
            continue
        if len(fresh) != len(leaves) or any(jnp.shape(v) != jnp.shape(p) for v, p in zip(values, leaves)):
            raise ValueError(
                "sync_params: the optimizer state was made for parameters of shapes "
                f"{[jnp.shape(v) for v in values]}, got {[jnp.shape(p) for p in leaves]}"
            )
        leaves = jax.lax.cond(
            jnp.any(jnp.stack(fresh)),
            lambda f, v, p: [jnp.where(*x) for x in zip(f, v, p)],
            lambda f, v, p: p,
            fresh,
            values,
            leaves,
        )
        params = jax.tree.unflatten(treedef, leaves)
    return params


def apply_updates(params: optax.Params, updates: optax.Updates, opt_state: optax.OptState) -> optax.Params:
    """``optax.apply_updates`` followed by ``sync_params``: after a synchronization every replica
    holds exactly the agreed parameters. A drop-in for ``optax.apply_updates(params, updates)``
    that also takes the new optimizer state.

    Example::

        updates, opt_state = tx.update(grads, opt_state, params)
        params = optaxdist.apply_updates(params, updates, opt_state)
    """
    return sync_params(optax.apply_updates(params, updates), opt_state)


__all__ = ["apply_updates", "sync_params"]
