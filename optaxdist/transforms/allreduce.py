"""Synchronous data parallelism: gradient all-reduce (``average_params``, parameter averaging
after every step, is ``local_sgd`` with period 1).

These are the baselines every other algorithm in optaxdist is measured against. They cover Heat's
``DataParallel`` (blocking and non-blocking modes give the same numbers), Apache SINGA's
``DistOpt`` plain and half-precision modes, and mlbench's ``CentralizedSGD`` / ``CentralizedAdam`` /
``CustomCentralizedOptimizer`` (with ``agg_grad=True`` and ``agg_grad=False``).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optaxdist.accounting import CommLedger, kind_name, payload_bytes
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator, canonical_comm_dtype, divides_first
from optaxdist.transforms._checks import check_comm, check_number, check_state

REDUCE_OPS = ("mean", "sum", "custom")


class AllReduceState(NamedTuple):
    """State of ``allreduce``: only the ledger of what was sent (replicated)."""

    allreduce_ledger: CommLedger


@configured("allreduce")
def allreduce(
    *,
    comm: Communicator,
    op: Literal["mean", "sum", "custom"] = "mean",
    divide_before: bool | None = None,
    dtype: Any = None,
    clip_value: float | None = None,
) -> optax.GradientTransformationExtraArgs:
    r"""All-reduce the gradients over ``comm``: every replica gets the same reduced gradient.

    With :math:`g_i` the gradient of replica :math:`i` of :math:`W`, :math:`c` the element-wise clip,
    and :math:`\mathrm{q}` rounding to the communication dtype:

    .. math::
        u = \frac{1}{D}\sum_{i=1}^{W} \mathrm{q}(c(g_i)) \quad\text{or, with divide\_before,}\quad
        u = \sum_{i=1}^{W} \mathrm{q}(c(g_i) / D)

    where :math:`D = W` for ``op="mean"``, :math:`D = 1` for ``op="sum"`` and :math:`D` is the
    ``denominator=`` extra argument of ``update`` for ``op="custom"`` (mlbench's ``avg_custom``,
    e.g. the global number of tokens). The result is cast back to each gradient's dtype.

    Place it before the local optimizer: ``optax.chain(allreduce(comm=c), optax.sgd(0.1))``.
    mlbench's ``CustomCentralizedOptimizer(grad_clip=...)`` clips the *averaged* gradient's global
    norm: chain ``optax.clip_by_global_norm`` after this transform.

    Communication:
      One all-reduce per step of every gradient leaf (merged by XLA's combiner), ``sum(numel(g))`` elements in
      ``dtype`` (the gradient's own dtype when None). Counted in the state's ledger as kind
      ``"all_reduce[<dtype>]"``.

    Args:
      comm: the group of replicas to reduce over.
      op: ``"mean"`` (default), ``"sum"``, or ``"custom"`` (divide by ``denominator=``).
      divide_before: divide by ``D`` before the sum instead of after. None (default): before
        when the type on the wire is 16-bit (``bfloat16``/``float16``, given as ``dtype`` or the
        gradient's own), so that a float16 sum cannot overflow where the mean would not; after
        otherwise (bitwise ``sum / W``). ``False`` reproduces SINGA's half mode.
      dtype: type on the wire: None (each gradient's dtype), ``float32``, ``bfloat16`` or
        ``float16`` (SINGA's half mode). Sums are computed in this dtype.
      clip_value: if set, clip every local gradient element to ``[-clip_value, clip_value]`` before
        the cast (SINGA half mode's ``clipping``/``clip_Value``, which keeps fp16 from overflowing).

    Example:
      >>> import jax, jax.numpy as jnp, optax, optaxdist
      >>> comm = optaxdist.AxisComm("replica")
      >>> tx = optax.chain(optaxdist.allreduce(comm=comm), optax.sgd(0.1))
      >>> params = jnp.zeros((4, 3))                       # 4 replicas of a 3-vector
      >>> grads = jnp.arange(12.0).reshape(4, 3)
      >>> def step(p, g):
      ...     u, _ = tx.update(g, tx.init(p), p)
      ...     return optax.apply_updates(p, u)
      >>> jax.vmap(step, axis_name="replica")(params, grads)[0]
      Array([-0.45000002, -0.55      , -0.65000004], dtype=float32)

    References:
      Heat ``heat.optim.DataParallelOptimizer``; SINGA ``DistOpt.backward_and_update(_half)``;
      mlbench ``CentralizedSGD``, ``CustomCentralizedOptimizer``.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"op={op!r} is not supported; allowed: {REDUCE_OPS}")
    if divide_before not in (None, True, False):
        raise ValueError(f"divide_before={divide_before!r}; allowed: None, True, False")
    wire_dtype = canonical_comm_dtype(dtype)
    if clip_value is not None:
        check_number("clip_value", clip_value, 0, open_low=True)
    check_comm("comm", comm)

    def init_fn(params):
        kind = kind_name("all_reduce", params, wire_dtype)
        return AllReduceState(CommLedger.create({kind: payload_bytes(params, wire_dtype)}))

    def update_fn(updates, state, params=None, *, denominator=None, **extra):
        check_state("allreduce", state, AllReduceState)
        del params, extra
        if op == "custom":
            if denominator is None:
                raise ValueError("allreduce(op='custom') needs update(..., denominator=D)")
            denom = jnp.asarray(denominator, jnp.float32)
        else:
            denom = jnp.asarray(comm.size if op == "mean" else 1, jnp.float32)

        def first(g):
            return divides_first(g.dtype, wire_dtype) if divide_before is None else divide_before

        def prepare(g):
            if clip_value is not None:
                g = jnp.clip(g, -clip_value, clip_value)
            return g / denom.astype(g.dtype) if first(g) else g

        reduced = comm.psum(jax.tree.map(prepare, updates), dtype=wire_dtype)
        reduced = jax.tree.map(lambda r, g: r if first(g) else r / denom.astype(r.dtype), reduced, updates)
        kind = kind_name("all_reduce", updates, wire_dtype)
        return reduced, AllReduceState(state.allreduce_ledger.record(kind))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
