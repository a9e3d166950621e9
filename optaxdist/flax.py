"""Flax NNX glue: a stateful NNX model (and ``nnx.Optimizer``) as stacked state for the harnesses.

``simulate`` and ``on_mesh`` map a *pure* per-replica function over *stacked* pytrees. NNX objects
are mutable Python graphs, so they cross that boundary as ``(graphdef, state)`` (``nnx.split`` /
``nnx.merge``). The three helpers here are that glue and nothing more:

- ``nnx_replicate(objects, n)``: split a module, or ``(model, optimizer)``, and stack its state
  ``n`` times (one row per replica), giving every replica its own RNG streams;
- ``nnx_step(graphdef, fn)``: turn ``fn(objects, *args)``, which updates the objects in place
  (``optimizer.update(model, grads)``, BatchNorm statistics, RNG counters), into the pure
  ``step(state, *args) -> (state, out)`` that ``simulate`` / ``on_mesh`` / ``on_mpi`` run;
- ``nnx_replica(graphdef, state, replica)``: rebuild one replica's objects from the stacked state
  (to evaluate it or read its optimizer state).

Linen's ``flax.training.train_state.TrainState`` needs none of this: it is already a pytree (its
``apply_fn`` and ``tx`` are static fields), so ``optaxdist.replicate(state, n)`` stacks it and the
step uses ``state.apply_gradients`` unchanged. See ``docs/flax.md``.

Example::

    import jax, jax.numpy as jnp, optax
    from flax import nnx
    import optaxdist as od

    comm = od.AxisComm("replica")
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.chain(od.allreduce(comm=comm), optax.sgd(0.1)), wrt=nnx.Param)
    graphdef, state = od.nnx_replicate((model, optimizer), 4)  # every leaf: leading axis of 4

    def train(objects, x, y):  # one replica; updates model and optimizer in place
        model, optimizer = objects
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return comm.pmean(loss)

    step = od.simulate(od.nnx_step(graphdef, train))
    x = jax.random.normal(jax.random.key(1), (4, 8, 3))  # a different batch per replica
    state, loss = step(state, x, x.sum(-1, keepdims=True))
    model, optimizer = od.nnx_replica(graphdef, state)  # replica 0
    print(od.comm_stats(optimizer.opt_state))  # 1 all-reduce of the 4 parameters
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from optaxdist.parallel.harness import replicate

if TYPE_CHECKING:
    from flax import nnx

__all__ = ["nnx_replica", "nnx_replicate", "nnx_step"]


def nnx_replicate(objects: Any, n: int, *, distinct_rngs: bool = True) -> tuple[nnx.GraphDef, nnx.State]:
    """Split NNX ``objects`` into ``(graphdef, state)`` with ``state`` stacked for ``n`` replicas.

    Args:
      objects: an ``nnx.Module``, an ``nnx.Optimizer``, or any pytree of them (typically
        ``(model, optimizer)``). Every replica starts from these values, so the parameters (and the
        optimizer state built from them) are identical on all replicas, as the synchronizing
        transforms expect.
      n: the number of replicas (the harness's group size).
      distinct_rngs: fold the replica index into every RNG key (``nnx.RngKey``: the streams of
        ``nnx.Rngs`` kept by ``nnx.Dropout`` and friends), so replicas draw different dropout masks
        on their different batches. ``False`` keeps identical streams on all replicas.

    Returns:
      ``(graphdef, state)``: the static structure, and ``nnx.state(objects)`` with a leading axis
      of length ``n`` on every leaf (row ``i`` belongs to replica ``i``).
    """
    from flax import nnx

    graphdef, state = nnx.split(objects)

    def stack(state):
        stacked = replicate(state, n)
        if not distinct_rngs:
            return stacked
        index = jnp.arange(n, dtype=jnp.uint32)

        def per_replica(v):
            if isinstance(v, nnx.RngKey):
                return jax.tree.map(lambda k: jax.vmap(jax.random.fold_in)(k, index), v)
            return v

        return jax.tree.map(per_replica, stacked, is_leaf=lambda x: isinstance(x, nnx.Variable))

    stacked = jax.jit(stack)(state)  # one compilation, not one per leaf shape
    return graphdef, stacked


def nnx_step(graphdef: nnx.GraphDef, fn: Callable[..., Any]) -> Callable[..., tuple[nnx.State, Any]]:
    """The pure per-replica step ``step(state, *args) -> (new_state, out)`` around ``fn``.

    ``step`` rebuilds the objects with ``nnx.merge(graphdef, state)``, calls ``out = fn(objects,
    *args)`` (which may update them in place: parameters and optimizer state through
    ``optimizer.update(model, grads)``, BatchNorm statistics, RNG counters) and returns their new
    state with ``out``. Wrap it in ``optaxdist.simulate``, ``optaxdist.on_mesh`` or
    ``optaxdist.on_mpi``. ``fn`` must not add or remove attributes (the structure, ``graphdef``,
    is static); a change raises ``ValueError``.
    """
    from flax import nnx

    def step(state, *args):
        objects = nnx.merge(graphdef, state)
        out = fn(objects, *args)
        new_graphdef, new_state = nnx.split(objects)
        if new_graphdef != graphdef:
            raise ValueError(
                "the step changed the structure of the NNX objects (added or removed an attribute "
                "or a Variable); only values may change inside a step"
            )
        return new_state, out

    return step


def nnx_replica(graphdef: nnx.GraphDef, state: nnx.State, replica: int | None = 0) -> Any:
    """Rebuild the NNX objects of one replica from a stacked ``state`` (for evaluation, logging,
    checkpointing replica 0, or ``optaxdist.comm_stats(optimizer.opt_state)``).

    Args:
      graphdef: from ``nnx_replicate``.
      state: the stacked state returned by a harness.
      replica: which row to take; ``None`` keeps the whole stack (every array keeps its leading
        replica axis, e.g. to pass ``optimizer.opt_state`` to ``comm_stats``, which then checks
        that all replicas counted the same).

    Returns:
      New objects (the same kind as those given to ``nnx_replicate``), independent of ``state``.
    """
    from flax import nnx

    if replica is not None:
        state = jax.tree.map(lambda x: x[replica], state)
    return nnx.merge(graphdef, state)
