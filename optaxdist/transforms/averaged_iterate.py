"""The weighted average of the iterates used by "Sparsified SGD with memory" (mlbench SparsifiedSGD)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist.agreement import configured
from optaxdist.transforms._checks import check_state, find_states


class AveragedIterateState(NamedTuple):
    """State of ``averaged_iterate`` (per replica): iterates seen and their weighted average."""

    average_count: jax.Array
    averaged_params: optax.Params


@configured("averaged_iterate")
def averaged_iterate(shift: float) -> optax.GradientTransformationExtraArgs:
    r"""Keep :math:`\hat w_T = \sum_{t \le T} (a+t)^2 w_t \,/\, \sum_{t \le T} (a+t)^2` of the iterates.

    Updates pass through unchanged; put it *last* in the chain so that :math:`w_t` =
    ``params + updates`` is the iterate after step :math:`t`. The running form is
    :math:`\hat w \leftarrow (1-\rho_t)\hat w + \rho_t w_t` with

    .. math:: \rho_t = \frac{6 (a+t)^2}{(1+t)(6a^2 + t + 6at + 2t^2)}, \qquad \rho_0 = 1.

    Read the average with ``averaged_params(opt_state)``.

    Communication: none.

    Args:
      shift: :math:`a > 0`; Stich et al. use :math:`a = d/k` (model size over coordinates sent).

    References:
      Stich, Cordonnier, Jaggi, "Sparsified SGD with Memory", NeurIPS 2018, Theorem 2.4.
      mlbench-core ``SparsifiedSGD.update_estimated_weights``.
    """
    if not shift > 0:
        raise ValueError(f"shift={shift!r} must be > 0")

    def init_fn(params):
        return AveragedIterateState(
            average_count=jnp.zeros((), jnp.int32),
            averaged_params=jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
        )

    def update_fn(updates, state, params=None, **extra):
        check_state("averaged_iterate", state, AveragedIterateState)
        del extra
        if params is None:
            raise ValueError("averaged_iterate needs params: call update(updates, state, params)")
        t = state.average_count.astype(jnp.float32)
        a = jnp.float32(shift)
        rho = 6 * (a + t) ** 2 / ((1 + t) * (6 * a**2 + t + 6 * a * t + 2 * t**2))
        iterate = optax.apply_updates(params, updates)
        averaged = jax.tree.map(
            lambda avg, w: ((1 - rho) * avg.astype(jnp.float32) + rho * w.astype(jnp.float32)).astype(
                avg.dtype
            ),
            state.averaged_params,
            iterate,
        )
        return updates, AveragedIterateState(optax.safe_increment(state.average_count), averaged)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def averaged_params(opt_state: Any) -> optax.Params:
    """The weighted average kept by the (single) ``averaged_iterate`` in a nested optimizer state."""
    found = find_states(opt_state, AveragedIterateState)
    if len(found) != 1:
        raise ValueError(f"found {len(found)} averaged_iterate states in opt_state; expected one")
    return found[0].averaged_params
