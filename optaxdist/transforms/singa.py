"""Apache SINGA's SGD (dampening from the first momentum step)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist.agreement import configured
from optaxdist.transforms._checks import check_sgd_hyperparameters


class SingaSgdState(NamedTuple):
    """State of ``singa_sgd`` (per replica): the step count and the momentum buffer."""

    count: jax.Array
    momentum_buffer: optax.Updates


@configured("singa_sgd")
def singa_sgd(
    learning_rate: optax.ScalarOrSchedule = 0.1,
    *,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""SGD exactly as Apache SINGA's ``opt.SGD``.

    .. math::
        g &\leftarrow g + \lambda p \\
        b &\leftarrow \mu b + (1 - d)\, g \qquad (b_0 = 0) \\
        g &\leftarrow g + \mu b \ \text{(nesterov)} \quad\text{else}\quad g \leftarrow b \\
        u &= -\eta_t\, g

    Unlike ``torch.optim.SGD`` (and ``optax.sgd``), whose buffer starts as :math:`b_1 = g_1`, SINGA
    starts from zero, so dampening applies from the first momentum step: the first update is
    :math:`(1-d)` times torch's. The two agree when ``dampening=0``.

    Communication: none (a local optimizer).

    Args:
      learning_rate: a float or an optax schedule (SINGA's ``ExponentialDecay`` is
        ``optax.exponential_decay(init_value, transition_steps=decay_steps, decay_rate=...)``).
      momentum: μ ≥ 0 (0 disables the buffer, as in SINGA).
      dampening: d.
      weight_decay: λ ≥ 0, coupled L2 added to the gradient.
      nesterov: Nesterov momentum; needs ``momentum > 0`` and ``dampening == 0``.

    References:
      Apache SINGA ``python/singa/opt.py`` ``SGD``.
    """
    check_sgd_hyperparameters(
        momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )

    def init_fn(params):
        buf = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        return SingaSgdState(count=jnp.zeros((), jnp.int32), momentum_buffer=buf)

    def update_fn(updates, state, params=None, **extra):
        del extra
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        if weight_decay:
            if params is None:
                raise ValueError("singa_sgd(weight_decay>0) needs params in update")
            updates = jax.tree.map(lambda g, p: g + weight_decay * p, updates, params)
        buf = state.momentum_buffer
        if momentum:
            buf = jax.tree.map(lambda b, g: momentum * b + (1 - dampening) * g, buf, updates)
            if nesterov:
                updates = jax.tree.map(lambda g, b: g + momentum * b, updates, buf)
            else:
                updates = buf
        updates = jax.tree.map(lambda g: -jnp.asarray(lr, g.dtype) * g, updates)
        return updates, SingaSgdState(count=optax.safe_increment(state.count), momentum_buffer=buf)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
