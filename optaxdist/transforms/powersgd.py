"""PowerSGD: low-rank gradient compression with error feedback and warm start.

One power-iteration step per training step approximates the *mean* gradient matrix by a rank-``r``
product ``P̂ Qᵀ``; replicas exchange only ``P`` (``n×r``) and ``Q`` (``m×r``) instead of ``n×m``
values. The numbers follow PyTorch's DDP ``powerSGD_hook`` (which the PowerSGD authors wrote) and
mlbench's ``PowerSGD``; the differences, and the bugs of the originals that are not reproduced, are
listed in ``docs/transforms/powersgd.md``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxdist._compat import pcast_varying, varying_axes
from optaxdist.accounting import CommLedger, Kind, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.transforms._checks import check_warmup_steps

P_KIND = Kind("all_reduce", "float32", label="powersgd_p")
Q_KIND = Kind("all_reduce", "float32", label="powersgd_q")
_F32 = jnp.dtype(jnp.float32)
_HIGHEST = jax.lax.Precision.HIGHEST


class PowerSgdState(NamedTuple):
    """State of ``powersgd``.

    The compressed leaves form *groups*: one group per distinct matrix shape ``(n, m)`` and dtype
    when ``batch_same_shape`` (else one group per leaf), in order of first appearance among the
    flattened gradient leaves. Group ``k`` holds ``B_k`` matrices.

    Attributes:
      powersgd_step: number of ``update`` calls so far (int32, replicated; saturates at 2**31 − 1).
        Steps with ``powersgd_step < warmup_steps`` are exact all-reduce steps.
      powersgd_q: per group, the ``(B, m, r)`` float32 query matrices (replicated): the random draw
        after ``init``, then the averaged ``Q`` of the last compressed step, which is where the next
        step starts from when ``warm_start``.
      powersgd_error: per group, the ``(B, n, m)`` float32 error-feedback residuals (per replica);
        the empty tuple when ``error_feedback=False``. Uncompressed leaves have no residual.
      powersgd_ledger: what this replica sent (replicated).
    """

    powersgd_step: jax.Array
    powersgd_q: tuple[jax.Array, ...]
    powersgd_error: tuple[jax.Array, ...]
    powersgd_ledger: CommLedger


@dataclasses.dataclass(frozen=True)
class _Group:
    n: int
    m: int
    r: int
    dtype: jnp.dtype  # the gradient dtype of every member
    leaves: tuple[int, ...]  # indices into the flattened gradient leaves


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static decisions, fixed by the leaves' shapes and dtypes: which leaves are compressed and
    how they are grouped, and which travel exactly."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[jnp.dtype, ...]
    groups: tuple[_Group, ...]
    exact: tuple[int, ...]  # uncompressed leaves (ndim ≤ 1, or failing the compression-rate test)

    def by_dtype(self, indices) -> dict[jnp.dtype, list[int]]:
        out: dict[jnp.dtype, list[int]] = {}
        for i in indices:
            out.setdefault(self.dtypes[i], []).append(i)
        return out

    def numel(self, i: int) -> int:
        return math.prod(self.shapes[i])


def _matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix view of a leaf: all axes but the last are rows, the last axis is the columns."""
    return math.prod(shape[:-1]), shape[-1]


def _make_plan(leaves, rank: int, min_compression_rate: float, batch_same_shape: bool) -> _Plan:
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
    groups: dict[Any, list] = {}
    exact = []
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        if len(shape) < 2 or not jnp.issubdtype(dt, jnp.floating):
            exact.append(i)
            continue
        n, m = _matrix_shape(shape)
        r = min(n, m, rank)
        if not (n + m) * r * min_compression_rate < n * m:
            exact.append(i)
            continue
        key = (n, m, dt) if batch_same_shape else i
        groups.setdefault(key, [n, m, r, dt, []])[4].append(i)
    return _Plan(
        shapes,
        dtypes,
        tuple(_Group(n, m, r, dt, tuple(ix)) for n, m, r, dt, ix in groups.values()),
        tuple(exact),
    )


def _kinds(plan: _Plan, warmup_steps: int) -> dict[Kind, int]:
    """Ledger kinds with the static payload (bytes) of one event of each."""
    kinds = {}
    if plan.groups:
        kinds[P_KIND] = 4 * sum(len(g.leaves) * g.n * g.r for g in plan.groups)
        kinds[Q_KIND] = 4 * sum(len(g.leaves) * g.m * g.r for g in plan.groups)
    for dt, ix in plan.by_dtype(plan.exact).items():
        kinds[Kind("all_reduce", dt.name)] = sum(plan.numel(i) for i in ix) * dt.itemsize
    if warmup_steps > 0:
        for dt, ix in plan.by_dtype(range(len(plan.shapes))).items():
            kinds[Kind("all_reduce", dt.name, label="powersgd_warmup")] = (
                sum(plan.numel(i) for i in ix) * dt.itemsize
            )
    return kinds


def _draw_q(seed: int, leaf: int, step, m: int, r: int) -> jax.Array:
    """The random query of one leaf: a function of (seed, leaf index, step) only, identical on
    every replica."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), leaf), step)
    return jax.random.normal(key, (m, r), _F32)


def _initial_q(seed: int, group: _Group) -> np.ndarray:
    """The initial draw of a group, ``(B, m, r)`` float32 standard normal: a constant computed
    on the host from NumPy's legacy ``RandomState`` seeded with ``[seed, leaf index]``, whose
    stream NumPy keeps frozen across versions, so every replica draws the same bits."""
    return np.stack(
        [
            np.random.RandomState([seed, i]).standard_normal((group.m, group.r)).astype(np.float32)
            for i in group.leaves
        ]
    )


def orthonormalize(a: jax.Array, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """Gram–Schmidt with re-orthogonalization on the columns of ``a`` (``(..., k, r)``, float32).

    Column ``i`` loses its projection on the finished columns ``0..i−1`` twice, then is divided by
    its norm if that norm exceeds ``epsilon`` and the second pass kept at least half of it;
    otherwise it becomes exactly zero (Kahan–Parlett "twice is enough": a column that loses more
    than half its norm in the second pass is rounding noise in the span of the previous columns).
    So the output columns are orthonormal to float32 precision or zero, never NaN, and ``A Aᵀ``
    is an orthogonal projection.

    Returns:
      The orthonormalized ``a`` and a ``(..., r)`` bool array: which columns were kept (norm > ε).
    """
    r = a.shape[-1]

    def column(i, carry):
        out, kept = carry
        v = jax.lax.dynamic_index_in_dim(a, i, axis=-1, keepdims=False)
        norms = []
        for _ in range(2):  # columns ≥ i of ``out`` are still zero: they remove nothing
            coef = jnp.einsum("...kr,...k->...r", out, v, precision=_HIGHEST)
            v = v - jnp.einsum("...kr,...r->...k", out, coef, precision=_HIGHEST)
            norms.append(jnp.sqrt(jnp.sum(v * v, axis=-1, keepdims=True)))
        norm = norms[1]
        # Kahan–Parlett: a second pass that removes more than half the norm means the column was
        # rounding noise inside the span of the previous ones: it is dependent, drop it.
        ok = (norm > epsilon) & (norm >= 0.5 * norms[0])
        v = jnp.where(ok, v / jnp.where(ok, norm, 1.0), 0.0)
        out = jax.lax.dynamic_update_index_in_dim(out, v, i, axis=-1)
        kept = jax.lax.dynamic_update_index_in_dim(kept, ok, i, axis=-1)
        return out, kept

    init = _like((jnp.zeros_like(a), jnp.zeros(a.shape[:-2] + (r,), jnp.bool_)), (a, a))
    if r == 1:
        return column(0, init)
    return jax.lax.fori_loop(0, r, column, init)


def _fused_psum(comm: Communicator, arrays: list[jax.Array], *, mean: bool) -> list[jax.Array]:
    """One all-reduce of several same-dtype arrays (flattened and concatenated)."""
    flat = jnp.concatenate([x.reshape(-1) for x in arrays])
    flat = comm.pmean(flat) if mean else comm.psum(flat)
    out, start = [], 0
    for x in arrays:
        out.append(flat[start : start + x.size].reshape(x.shape))
        start += x.size
    return out


def _like(new, old):
    """``new`` marked varying over the mesh axes over which ``old`` varies (shard_map types)."""
    return jax.tree.map(lambda n, o: pcast_varying(n, tuple(varying_axes(o))), new, old)


@configured("powersgd")
def powersgd(
    *,
    comm: Communicator,
    rank: int = 1,
    warmup_steps: int = 1000,
    min_compression_rate: float = 2.0,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float = 1e-8,
    seed: int = 0,
    batch_same_shape: bool = True,
    compress_single_replica: bool = False,
) -> optax.GradientTransformationExtraArgs:
    r"""PowerSGD: all-reduce a rank-``r`` approximation of the mean gradient, with error feedback.

    Place it before the local optimizer: ``optax.chain(powersgd(comm=c, rank=2), optax.sgd(0.1))``.
    The output is an approximation of the mean gradient, identical on every replica.

    Every leaf with two or more axes is viewed as a matrix :math:`n \times m` (all axes but the
    last are rows, the last axis is the columns: ``(..., in, out)`` kernels become fan-in × out).
    With :math:`r = \min(n, m, \text{rank})`, the matrix is compressed when
    :math:`(n + m)\, r \cdot \text{min\_compression\_rate} < n m`; other leaves (all 1-D leaves and
    scalars, small or very rectangular matrices) are averaged exactly. On replica :math:`i` of
    :math:`W`, for each compressed matrix, with residual :math:`e_i` (zero at the start):

    .. math::
        M_i &= g_i + e_i \\
        \hat Q &= \mathrm{orth}(Q) \qquad (Q: \text{last step's averaged } Q \text{ if warm\_start,
                  else a fresh random draw}) \\
        \hat P &= \mathrm{orth}\Big(\textstyle\sum_j M_j \hat Q\Big) \\
        Q &\leftarrow \tfrac{1}{W} \textstyle\sum_j M_j^\top \hat P \\
        u &= \hat P Q^\top, \qquad e_i \leftarrow M_i - u

    ``orth`` is Gram–Schmidt with re-orthogonalization; a column whose norm is at most
    ``orthogonalization_epsilon``, or that is numerically dependent on the previous columns,
    becomes zero (never NaN), and its part stays in the residual. If a
    warm-started :math:`Q` has such a column (after an all-zero gradient, say), the step starts from
    its initial draw instead, so a matrix never gets stuck at zero. The initial :math:`Q` is drawn
    on the host with NumPy's ``RandomState([seed, leaf index])`` (a stream NumPy keeps frozen);
    with ``warm_start=False`` each step draws from ``jax.random.key(seed)`` folded with the leaf
    index and the step. Both are the same on every replica.
    With ``rank ≥ min(n, m)`` the approximation is exact: :math:`u = \frac{1}{W}\sum_j M_j`.
    :math:`P`, :math:`Q` and residuals are float32 whatever the gradient dtype; :math:`u` is cast
    back to it and the residual is taken against that cast value.

    For the first ``warmup_steps`` steps every leaf is averaged exactly and the residuals stay zero.
    With a single replica (``comm.size == 1``) the transform is the identity (nothing to
    communicate, so nothing to compress) unless ``compress_single_replica=True`` (PyTorch's
    behaviour).

    Communication:
      Warm-up steps (``step < warmup_steps``): one all-reduce per gradient dtype of all leaves
      (``Σ numel`` elements in the leaves' dtype), ledger kind ``"powersgd_warmup[<dtype>]"``.
      Compressed steps: one all-reduce (sum) of all :math:`P` (``Σ n·r`` float32 elements,
      ``"powersgd_p[float32]"``), then one all-reduce (mean) of all :math:`Q` (``Σ m·r`` float32
      elements, ``"powersgd_q[float32]"``), sums over the compressed matrices; plus one all-reduce
      per dtype of the uncompressed leaves (``Σ numel``, their dtype, ``"all_reduce[<dtype>]"``).
      Kinds with nothing to send are absent. With one replica (and no ``compress_single_replica``)
      nothing is sent or counted.

    State:
      ``PowerSgdState``: step counter and ``Q`` matrices replicated, residuals per replica.

    Args:
      comm: the group of replicas to average over.
      rank: the approximation rank :math:`r` (an int ≥ 1; PyTorch: 1, try 1, 2, 4).
      warmup_steps: number of initial steps with exact all-reduce (an int ≥ 0; PyTorch's
        ``start_powerSGD_iter``, 1000; about 10% of training and at least the LR warm-up).
      min_compression_rate: compress a matrix only if it saves at least this factor (> 0; 2).
      error_feedback: add the residual of the previous step before compressing (True).
      warm_start: start each step's power iteration from the previous averaged :math:`Q` (True).
      orthogonalization_epsilon: columns with norm ≤ this are zeroed (≥ 0; 1e-8). PyTorch adds
        its epsilon (default 0) to the norm instead, and gives NaN for a zero column when it is 0.
      seed: seed of the random :math:`Q` draws (PyTorch's ``random_seed``, 0).
      batch_same_shape: stack same-shaped matrices and use batched matmuls (speed only).
      compress_single_replica: compress even with one replica (PyTorch does; mlbench does not).

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, optaxdist
      >>> from optaxdist.transforms.powersgd import powersgd
      >>> comm = optaxdist.AxisComm("replica")
      >>> tx = optax.chain(powersgd(comm=comm, rank=1, warmup_steps=0), optax.sgd(0.1))
      >>> grads = jnp.stack([jnp.outer(jnp.arange(1.0, 9.0), jnp.ones(6)) * (i + 1)
      ...                    for i in range(4)])       # 4 replicas, rank-1 8×6 gradients
      >>> def step(g):
      ...     u, s = tx.update(g, tx.init(g))
      ...     return u
      >>> u = jax.vmap(step, axis_name="replica")(grads)
      >>> bool(jnp.allclose(u[0], -0.1 * grads.mean(0), rtol=1e-5))  # a rank-1 mean: exact
      True

    References:
      Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
      Distributed Optimization", NeurIPS 2019. PyTorch ``torch.distributed.algorithms.
      ddp_comm_hooks.powerSGD_hook``; mlbench ``PowerSGD`` / ``PowerAggregation``.
    """
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be an optaxdist Communicator, got {type(comm).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank={rank!r} must be an int ≥ 1")
    check_warmup_steps(warmup_steps)
    if (
        isinstance(min_compression_rate, bool)
        or not isinstance(min_compression_rate, (int, float))
        or not 0 < min_compression_rate < math.inf
    ):
        raise ValueError(f"min_compression_rate={min_compression_rate!r} must be a finite number > 0")
    if (
        isinstance(orthogonalization_epsilon, bool)
        or not isinstance(orthogonalization_epsilon, (int, float))
        or not 0 <= orthogonalization_epsilon < math.inf
    ):
        raise ValueError(
            f"orthogonalization_epsilon={orthogonalization_epsilon!r} must be a finite number ≥ 0"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed!r} must be an int in [0, 2**32)")
    for name, flag in [
        ("error_feedback", error_feedback),
        ("warm_start", warm_start),
        ("batch_same_shape", batch_same_shape),
        ("compress_single_replica", compress_single_replica),
    ]:
        if not isinstance(flag, bool):
            raise ValueError(f"{name}={flag!r} must be a bool")
    eps = float(orthogonalization_epsilon)

    def plan_of(leaves) -> _Plan:
        return _make_plan(leaves, rank, float(min_compression_rate), batch_same_shape)

    def init_fn(params):
        leaves = jax.tree.leaves(params)
        plan = plan_of(leaves)
        qs = tuple(jnp.asarray(_initial_q(seed, g)) for g in plan.groups)
        errors = ()
        if error_feedback:
            errors = tuple(per_replica(jnp.zeros((len(g.leaves), g.n, g.m), _F32), comm) for g in plan.groups)
        return PowerSgdState(
            powersgd_step=jnp.zeros((), jnp.int32),
            powersgd_q=qs,
            powersgd_error=errors,
            powersgd_ledger=CommLedger.create(_kinds(plan, warmup_steps)),
        )

    def exact_step(plan: _Plan, leaves):
        out = list(leaves)
        for ix in plan.by_dtype(range(len(leaves))).values():
            for i, x in zip(ix, _fused_psum(comm, [leaves[i] for i in ix], mean=True)):
                out[i] = x
        return out

    def compressed_step(plan: _Plan, leaves, state: PowerSgdState, step):
        out = list(leaves)
        for ix in plan.by_dtype(plan.exact).values():
            for i, x in zip(ix, _fused_psum(comm, [leaves[i] for i in ix], mean=True)):
                out[i] = x

        ms, q_starts = [], []
        for k, g in enumerate(plan.groups):
            m = jnp.stack([leaves[i].astype(_F32).reshape(g.n, g.m) for i in g.leaves])
            if error_feedback:
                m = m + state.powersgd_error[k]
            ms.append(m)
            if warm_start:
                with jax.ensure_compile_time_eval():  # a constant: computed once, at trace time
                    restart, _ = orthonormalize(jnp.asarray(_initial_q(seed, g)), eps)
                warm, kept = orthonormalize(state.powersgd_q[k], eps)
                usable = jnp.all(kept, axis=-1)[:, None, None]
                q_starts.append(jnp.where(usable, warm, restart))
            else:
                fresh = jnp.stack([_draw_q(seed, i, step, g.m, g.r) for i in g.leaves])
                q_starts.append(orthonormalize(fresh, eps)[0])

        if not plan.groups:
            return out, state.powersgd_q, state.powersgd_error

        ps = [jnp.einsum("bnm,bmr->bnr", m, q, precision=_HIGHEST) for m, q in zip(ms, q_starts)]
        ps = [orthonormalize(p, eps)[0] for p in _fused_psum(comm, ps, mean=False)]
        qs = [jnp.einsum("bnm,bnr->bmr", m, p, precision=_HIGHEST) for m, p in zip(ms, ps)]
        qs = _fused_psum(comm, qs, mean=True)

        errors = []
        for k, g in enumerate(plan.groups):
            # One product per member, written straight into its output leaf (slicing a batched
            # (B, n, m) reconstruction would copy every matrix once more).
            sent = [
                jnp.matmul(ps[k][b], qs[k][b].T, precision=_HIGHEST).astype(g.dtype)
                for b in range(len(g.leaves))
            ]
            for b, i in enumerate(g.leaves):
                out[i] = sent[b].reshape(plan.shapes[i])
            if error_feedback:
                errors.append(per_replica(ms[k] - jnp.stack(sent).astype(_F32), comm))
        return (
            out,
            _like(tuple(qs), state.powersgd_q),
            _like(tuple(errors), state.powersgd_error),
        )

    def update_fn(updates, state, params=None, **extra):
        del params, extra
        leaves, treedef = jax.tree.flatten(updates)
        leaves = [jnp.asarray(x) for x in leaves]
        plan = plan_of(leaves)
        have = [q.shape for q in state.powersgd_q] + [e.shape for e in state.powersgd_error]
        want = [(len(g.leaves), g.m, g.r) for g in plan.groups]
        if error_feedback:
            want += [(len(g.leaves), g.n, g.m) for g in plan.groups]
        if have != want:
            raise ValueError(
                "powersgd: the gradient leaves do not match the shapes given to init "
                f"(compressed groups {[(len(g.leaves), g.n, g.m) for g in plan.groups]})"
            )
        step = comm.uniform(state.powersgd_step)  # keeps the warm-up a branch under simulate
        next_step = optax.safe_increment(step)
        ledger = state.powersgd_ledger

        if comm.size == 1 and not compress_single_replica:
            return updates, state._replace(powersgd_step=next_step)

        def compressed(_):
            return compressed_step(plan, leaves, state, step)

        if warmup_steps > 0:
            warmup = step < warmup_steps

            def exact(_):
                return exact_step(plan, leaves), state.powersgd_q, state.powersgd_error

            out, qs, errors = jax.lax.cond(warmup, exact, compressed, None)
            for dt in plan.by_dtype(range(len(leaves))):
                ledger = ledger.record(
                    Kind("all_reduce", dt.name, label="powersgd_warmup"), warmup.astype(jnp.int32)
                )
            compressing = (~warmup).astype(jnp.int32)
        else:
            out, qs, errors = compressed(None)
            compressing = 1
        if plan.groups:
            ledger = ledger.record(P_KIND, compressing).record(Q_KIND, compressing)
        for dt in plan.by_dtype(plan.exact):
            ledger = ledger.record(Kind("all_reduce", dt.name), compressing)

        new_state = PowerSgdState(
            powersgd_step=next_step, powersgd_q=qs, powersgd_error=errors, powersgd_ledger=ledger
        )
        return jax.tree.unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
