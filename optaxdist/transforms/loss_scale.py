"""Dynamic loss scaling that skips non-finite steps together on every replica.

mlbench's ``FP16Optimizer`` and PyTorch's ``GradScaler`` / Flax's ``DynamicScale`` share one rule:
divide the gradient by the scale; if any replica sees a non-finite value, every replica skips the
step and halves the scale; after ``growth_interval`` consecutive finite steps, grow the scale.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger, Kind, keep_ledgers
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.transforms._checks import all_finite, check_comm, check_number, check_state, find_states

AGREE_KIND = Kind("all_reduce", "int32", label="agree")
_F32_TINY = float(np.finfo(np.float32).tiny)


class DynamicLossScaleState(NamedTuple):
    """State of ``dynamic_loss_scale``. All fields but ``inner_state`` are replicated.

    Attributes:
      loss_scale: current scale (float32); multiply the loss by it (``scale_loss``).
      good_steps: consecutive finite steps since the last growth or overflow (int32).
      skipped_steps: total number of skipped steps (int32).
      inner_state: the wrapped optimizer's state (untouched on skipped steps).
      loss_scale_ledger: count of the agreement all-reduces (when ``comm`` is given).
    """

    loss_scale: jax.Array
    good_steps: jax.Array
    skipped_steps: jax.Array
    inner_state: optax.OptState
    loss_scale_ledger: CommLedger


def _raise_min_scale(exhausted) -> None:
    if np.any(exhausted):
        raise FloatingPointError("Minimum loss scale reached: the gradients keep overflowing")


@configured("dynamic_loss_scale")
def dynamic_loss_scale(
    inner: optax.GradientTransformation,
    *,
    comm: Communicator | None = None,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    min_scale: float = _F32_TINY,
    max_scale: float | None = None,
    raise_at_min_scale: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""Unscale gradients, skip non-finite steps on all replicas together, and adapt the scale.

    The user multiplies the loss by ``state.loss_scale`` (``scale_loss(loss, opt_state)``) before
    differentiating. Each step, with :math:`s` the scale:

    1. :math:`\tilde g = g / s`; run ``inner`` on :math:`\tilde g` (its collectives run every step,
       so no replica ever waits for another).
    2. ``finite`` = all of :math:`\tilde g` and the inner updates are finite on *every* replica of
       ``comm`` (an all-reduce of one int32). This also catches overflow inside a low-precision
       all-reduce of ``inner``.
    3. finite: apply the inner updates and state; ``good += 1``; when ``good`` reaches
       ``growth_interval``, :math:`s \leftarrow \min(s \cdot \text{growth}, \text{max})` and ``good = 0``.
       Not finite: updates are zero, the inner state is kept unchanged (its communication ledgers
       still count what was sent), :math:`s \leftarrow \max(s \cdot \text{backoff}, \text{min})`,
       ``good = 0``; with ``raise_at_min_scale`` an overflow at :math:`s \cdot
       \text{backoff} \le \text{min}` raises ``FloatingPointError`` (mlbench's behaviour).

    Communication:
      With ``comm``: one all-reduce of one int32 (4 bytes) per step, ledger kind
      ``"agree[int32]"``, plus whatever ``inner`` sends. Without ``comm``: nothing.

    Args:
      inner: the optimizer to protect, typically ``optax.chain(allreduce(comm=c), optax.sgd(...))``.
      comm: the group whose replicas must skip together; None for a single replica.
      init_scale: initial scale (mlbench FP16Optimizer: 1024). The defaults are PyTorch's
        ``GradScaler`` / Flax's ``DynamicScale``: 2**16, ×2 every 2000 finite steps, ×0.5 on overflow.
      growth_factor: factor applied after ``growth_interval`` finite steps (≥ 1).
      backoff_factor: factor applied on overflow (in (0, 1]).
      growth_interval: number of consecutive finite steps before growing (≥ 1).
      min_scale: lower bound of the scale (> 0).
      max_scale: optional upper bound of the scale.
      raise_at_min_scale: raise instead of clamping when an overflow hits ``min_scale``.

    Example:
      >>> tx = dynamic_loss_scale(optax.chain(optaxdist.allreduce(comm=c), optax.sgd(0.1)), comm=c)
      >>> params = jnp.ones(2)
      >>> opt_state = tx.init(params)
      >>> jax.grad(lambda p: scale_loss(jnp.sum(p**2), opt_state))(params)  # the scaled gradient
      Array([131072., 131072.], dtype=float32)

    References:
      Micikevicius et al., "Mixed Precision Training", ICLR 2018. mlbench ``FP16Optimizer``;
      PyTorch ``torch.amp.GradScaler``; Flax ``DynamicScale``.
    """
    growth_interval = check_int("growth_interval", growth_interval, 1)
    check_number("init_scale", init_scale, 0, open_low=True)
    check_number("growth_factor", growth_factor, 1)
    check_number("backoff_factor", backoff_factor, 0, 1, open_low=True, open_high=False)
    check_number("min_scale", min_scale, 0, open_low=True)
    if max_scale is not None:
        check_number("max_scale", max_scale, init_scale)
    check_bools(raise_at_min_scale=raise_at_min_scale)
    if comm is not None:
        check_comm("comm", comm)
    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return DynamicLossScaleState(
            loss_scale=jnp.asarray(init_scale, jnp.float32),
            good_steps=jnp.zeros((), jnp.int32),
            skipped_steps=jnp.zeros((), jnp.int32),
            inner_state=inner.init(params),
            loss_scale_ledger=CommLedger.create({AGREE_KIND: 4} if comm is not None else {}),
        )

    def update_fn(updates, state, params=None, **extra):
        check_state("dynamic_loss_scale", state, DynamicLossScaleState)
        scale = state.loss_scale
        unscaled = jax.tree.map(lambda g: (g.astype(jnp.float32) / scale).astype(g.dtype), updates)
        new_updates, new_inner = inner.update(unscaled, state.inner_state, params, **extra)
        finite = all_finite(unscaled) & all_finite(new_updates)
        ledger = state.loss_scale_ledger
        if comm is not None:
            finite = comm.agree(finite, op="all")
            ledger = ledger.record(AGREE_KIND)

        out = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), new_updates)
        kept = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_inner, state.inner_state)
        inner_state = keep_ledgers(kept, new_inner)

        good = jnp.where(finite, state.good_steps + 1, 0)
        grow = good >= growth_interval
        grown = scale * growth_factor
        if max_scale is not None:
            grown = jnp.minimum(grown, max_scale)
        backed_off = scale * backoff_factor
        if raise_at_min_scale:
            jax.debug.callback(_raise_min_scale, ~finite & (backed_off <= min_scale))
        new_scale = jnp.where(
            finite, jnp.where(grow, grown, scale), jnp.maximum(backed_off, min_scale)
        ).astype(jnp.float32)
        return out, DynamicLossScaleState(
            loss_scale=new_scale,
            good_steps=jnp.where(grow, 0, good).astype(jnp.int32),
            skipped_steps=state.skipped_steps + jnp.where(finite, 0, 1).astype(jnp.int32),
            inner_state=inner_state,
            loss_scale_ledger=ledger,
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@configured("mlbench_loss_scale")
def mlbench_loss_scale(
    inner: optax.GradientTransformation, *, comm: Communicator | None = None, **overrides: Any
) -> optax.GradientTransformationExtraArgs:
    """mlbench ``FP16Optimizer`` defaults: init 1024, ×2 every 128 finite steps, ×0.5 on overflow,
    minimum 1e-4 which raises ``FloatingPointError`` when reached."""
    kw = dict(
        init_scale=1024.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=128,
        min_scale=1e-4,
        raise_at_min_scale=True,
    )
    return dynamic_loss_scale(inner, comm=comm, **(kw | overrides))


@configured("skip_nonfinite")
def skip_nonfinite(
    inner: optax.GradientTransformation, *, comm: Communicator | None = None
) -> optax.GradientTransformationExtraArgs:
    """Skip a step on every replica when any replica sees a non-finite value (a fixed scale of 1)."""
    return dynamic_loss_scale(
        inner, comm=comm, init_scale=1.0, growth_factor=1.0, backoff_factor=1.0, min_scale=1.0
    )


def scale_loss(loss: jax.Array, opt_state: Any) -> jax.Array:
    """``loss × loss_scale`` with the scale read from a (nested) ``dynamic_loss_scale`` state."""
    scales = [s.loss_scale for s in find_states(opt_state, DynamicLossScaleState)]
    if len(scales) != 1:
        raise ValueError(
            f"scale_loss found {len(scales)} dynamic_loss_scale states in opt_state; expected one"
        )
    return loss * scales[0].astype(loss.dtype)
