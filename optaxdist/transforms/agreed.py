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
from optaxdist.transforms.local_program import static_flag
from optaxdist.transforms.periodic import AGREED, UNTOUCHED, AgreedParams, PeriodicState


def sync_params(params: optax.Params, opt_state: optax.OptState) -> optax.Params:
    """``params`` (after ``optax.apply_updates``) with every leaf the last update synchronized set
    to the value the replicas agreed on, bit for bit.

    Call it on each replica after the update, with the optimizer state that update returned. On
    steps without a synchronization, and for states made with ``exact_sync=False``, it returns
    ``params`` unchanged. Cost: an element-wise select over the parameters (none on a mesh or under
    MPI on steps where nothing was agreed: a ``lax.cond``). With transforms nested in one another
    the outermost decides: a leaf an outer synchronization changed (a gossip mix, a blended merge)
    or agreed on is not overwritten by an inner one. States inside ``optax.masked`` /
    ``optax.multi_transform`` cover their own leaves.

    Example (Flax NNX, whose ``Optimizer.update`` calls ``optax.apply_updates``)::

        optimizer.update(model, grads)
        params = nnx.state(model, nnx.Param)
        nnx.update(model, optaxdist.sync_params(params, optimizer.opt_state))
    """
    leaves, treedef = jax.tree.flatten(params)
    claimed: list = [False] * len(leaves)  # set by a synchronization further out
    for state in find_states(opt_state, (PeriodicState, DasoState)):  # outermost first
        if not isinstance(state.agreed, AgreedParams):
            continue
        # leaf by leaf: the state may wrap them differently (Flax NNX's OptVariable for Param)
        # and skip the leaves a mask gave to another transformation (optax.MaskedNode)
        slots = jax.tree.leaves(state.agreed.fresh, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
        mine = [i for i, s in enumerate(slots) if not isinstance(s, optax.MaskedNode)]
        if len(slots) != len(leaves):
            raise ValueError(
                f"sync_params: the optimizer state was made for {len(slots)} parameter leaves, "
                f"got {len(leaves)}"
            )
        known = [static_flag(slots[i]) for i in mine]  # a harness's program of fixed branches
        if all(k == UNTOUCHED for k in known):
            continue  # nothing agreed, and nothing changed: no select, no values read
        like = [leaves[i] for i in mine]
        fresh, values = state.agreed_leaves(like)
        if any(jnp.shape(v) != jnp.shape(p) for v, p in zip(values, like)):
            raise ValueError(
                "sync_params: the optimizer state was made for parameters of shapes "
                f"{[jnp.shape(v) for v in values]}, got {[jnp.shape(p) for p in like]}"
            )
        if None not in known and all(isinstance(claimed[i], bool) for i in mine):
            for i, k, v in zip(mine, known, values):
                if k == AGREED and not claimed[i]:
                    leaves[i] = v
                claimed[i] = claimed[i] or k != UNTOUCHED
            continue
        take = [(f == AGREED) & ~jnp.asarray(claimed[i]) for f, i in zip(fresh, mine)]
        new = jax.lax.cond(
            jnp.any(jnp.stack(take)),
            lambda t, v, p: [jnp.where(*x) for x in zip(t, v, p)],
            lambda t, v, p: p,
            take,
            values,
            like,
        )
        for i, f, x in zip(mine, fresh, new):
            leaves[i], claimed[i] = x, claimed[i] | (f != UNTOUCHED)
    return jax.tree.unflatten(treedef, leaves)


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
