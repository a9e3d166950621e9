"""mlbench's SignSGD: a local optimizer stepping by the sign of the (momentum) direction."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist.agreement import configured
from optaxdist.transforms._checks import check_sgd_hyperparameters


class SignSgdState(NamedTuple):
    """State of ``sign_sgd`` (per replica): step count and momentum buffer."""

    count: jax.Array
    sign_momentum: optax.Updates


@configured("sign_sgd")
def sign_sgd(
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""SignSGD (mlbench ``SignSGD``): step by the sign of the momentum direction.

    .. math::
        d &= g + \lambda p \\
        b &= d \ \text{(first step)}, \qquad b \leftarrow \mu b + (1 - \tau) d \ \text{(after)} \\
        d &\leftarrow d + \mu b \ \text{(nesterov)} \quad\text{else}\quad d \leftarrow b \\
        u &= -\eta_t\, \mathrm{sign}(d) \qquad (\mathrm{sign}(0) = 0)

    As in torch and mlbench, the buffer starts as the first direction (no dampening on the first
    step). A local optimizer: it sends nothing. For signSGD *with majority vote* put
    ``compressed_allreduce(compress.sign(), comm=c, error_feedback=False)`` before it.

    Args:
      learning_rate: η, a float or an optax schedule.
      momentum: μ ≥ 0 (0: no buffer).
      dampening: τ, applied from the second step.
      weight_decay: λ ≥ 0, coupled.
      nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).

    References:
      Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex Problems", ICML 2018.
      mlbench-core ``mlbench_core.optim.pytorch.optim.SignSGD``.
    """
    check_sgd_hyperparameters(
        momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )

    def init_fn(params):
        return SignSgdState(
            count=jnp.zeros((), jnp.int32),
            sign_momentum=jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params),
        )

    def update_fn(updates, state, params=None, **extra):
        del extra
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        d = updates
        if weight_decay:
            if params is None:
                raise ValueError("sign_sgd(weight_decay>0) needs params in update")
            d = jax.tree.map(lambda g, p: g + weight_decay * p, d, params)
        buf = state.sign_momentum
        if momentum:
            first = state.count == 0
            buf = jax.tree.map(lambda b, x: jnp.where(first, x, momentum * b + (1 - dampening) * x), buf, d)
            d = jax.tree.map(lambda x, b: x + momentum * b, d, buf) if nesterov else buf
        out = jax.tree.map(lambda x: -jnp.asarray(lr, x.dtype) * jnp.sign(x), d)
        return out, SignSgdState(count=optax.safe_increment(state.count), sign_momentum=buf)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
