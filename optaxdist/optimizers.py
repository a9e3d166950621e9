"""The seed systems' local optimizers: Apache SINGA's SGD and mlbench's SignSGD. They send
nothing; chain them after a communicating transform (``allreduce``, ``compressed_allreduce``)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist._validate import check_bools
from optaxdist.agreement import configured
from optaxdist.transforms._checks import check_number


def _check_sgd_hyperparameters(
    *, momentum: float, dampening: float, weight_decay: float, nesterov: bool
) -> None:
    """torch.optim.SGD's rules: momentum ≥ 0, weight_decay ≥ 0, nesterov needs momentum > 0 and
    no dampening."""
    check_number("momentum", momentum, 0)
    check_number("dampening", dampening)
    check_number("weight_decay", weight_decay, 0)
    check_bools(nesterov=nesterov)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError("nesterov=True needs momentum > 0 and dampening == 0")


def _sgd(
    name: str,
    learning_rate: optax.ScalarOrSchedule,
    *,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    buffer_starts_at_gradient: bool,
    finish,
    state_type,
) -> optax.GradientTransformationExtraArgs:
    """torch-style SGD: coupled weight decay, a momentum buffer (torch starts it at the first
    direction; SINGA at zero, so dampening applies from the first step), Nesterov; the direction
    ``d`` becomes the update ``−η_t · finish(d)``."""
    _check_sgd_hyperparameters(
        momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov
    )

    def init_fn(params):
        return state_type(
            jnp.zeros((), jnp.int32), jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
        )

    def update_fn(updates, state, params=None, **extra):
        del extra
        count, buf = state
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        d = updates
        if weight_decay:
            if params is None:
                raise ValueError(f"{name}(weight_decay>0) needs params in update")
            d = jax.tree.map(lambda g, p: g + weight_decay * p, d, params)
        if momentum:
            first = (count == 0) & buffer_starts_at_gradient
            buf = jax.tree.map(lambda b, x: jnp.where(first, x, momentum * b + (1 - dampening) * x), buf, d)
            d = jax.tree.map(lambda x, b: x + momentum * b, d, buf) if nesterov else buf
        out = jax.tree.map(lambda x: -jnp.asarray(lr, x.dtype) * finish(x), d)
        return out, state_type(optax.safe_increment(count), buf)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


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
    return _sgd(
        "singa_sgd",
        learning_rate,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        buffer_starts_at_gradient=False,
        finish=lambda d: d,
        state_type=SingaSgdState,
    )


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
    return _sgd(
        "sign_sgd",
        learning_rate,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        buffer_starts_at_gradient=True,
        finish=jnp.sign,
        state_type=SignSgdState,
    )
