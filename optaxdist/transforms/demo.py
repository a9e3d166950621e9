"""DeMo: decoupled momentum. Each replica keeps its own momentum and sends, every step, the few
largest DCT coefficients of each block of it; what it sent leaves its momentum (error feedback)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optaxdist._validate import check_bools, check_int
from optaxdist.accounting import CommLedger, Kind, payload_bytes, per_replica
from optaxdist.agreement import configured
from optaxdist.comm.base import Communicator
from optaxdist.compress.chunked import pack_bits, unpack_bits
from optaxdist.transforms._checks import all_finite, check_comm, check_nonfinite, check_number, check_state

F32 = jnp.float32
HIGHEST = jax.lax.Precision.HIGHEST


class DemoState(NamedTuple):
    """State of ``demo``.

    Attributes:
      demo_step: steps taken (int32, replicated, saturating); the learning-rate schedule's count.
      demo_momentum: the replica's momentum, one float32 array per parameter leaf (per replica:
        the replicas' momenta differ, that is the point of DeMo).
      demo_ledger: what this replica sent (replicated).
    """

    demo_step: jax.Array
    demo_momentum: Any
    demo_ledger: CommLedger


def dct_matrix(n: int) -> np.ndarray:
    r"""The orthonormal DCT-II matrix :math:`D` of size ``n`` (float64): the coefficients of a
    vector :math:`x` are :math:`D x`, and :math:`D^{-1} = D^\top`.

    .. math::
        D_{kj} = \sqrt{\tfrac{2}{n}}\, c_k \cos\frac{\pi (2j + 1) k}{2n}, \qquad
        c_0 = \tfrac{1}{\sqrt 2},\ c_{k>0} = 1

    (``scipy.fft.dct(x, norm="ortho")``).
    """
    k, j = np.arange(n)[:, None], np.arange(n)[None, :]
    d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
    d[0] /= np.sqrt(2.0)
    return d


def block_side(n: int, chunk_size: int) -> int:
    """The block length along an axis of ``n`` values: ``n`` itself when ``n ≤ chunk_size``, else
    the largest divisor of ``n`` not above ``chunk_size`` (the reference's choice: no padding; an
    axis of prime length above ``chunk_size`` gets blocks of 1; an empty axis, blocks of 1 and
    none of them)."""
    return max((d for d in range(1, min(n, chunk_size) + 1) if n % d == 0), default=1)


class _Leaf(NamedTuple):
    """How one leaf is cut: viewed as a ``rows × cols`` matrix, in blocks of ``h × w`` values,
    ``k`` coefficients kept per block, each index in ``bits`` bits."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    h: int
    w: int
    k: int

    @property
    def blocks(self) -> int:
        return (self.rows // self.h) * (self.cols // self.w)

    @property
    def bits(self) -> int:
        return math.ceil(math.log2(self.h * self.w))


def _leaf_plan(shape: tuple[int, ...], chunk_size: int, k: int) -> _Leaf:
    rows, cols = (1, math.prod(shape)) if len(shape) < 2 else (math.prod(shape[:-1]), shape[-1])
    h, w = block_side(rows, chunk_size), block_side(cols, chunk_size)
    return _Leaf(tuple(shape), rows, cols, h, w, min(k, h * w))


def _coefficients(x: jax.Array, leaf: _Leaf) -> jax.Array:
    """The 2-D DCT of every block of ``x``: ``(blocks, h·w)``."""
    dh, dw = (jnp.asarray(dct_matrix(n), F32) for n in (leaf.h, leaf.w))
    x = x.reshape(leaf.rows // leaf.h, leaf.h, leaf.cols // leaf.w, leaf.w)
    c = jnp.einsum("yixj,bi,dj->yxbd", x, dh, dw, precision=HIGHEST)
    return c.reshape(leaf.blocks, leaf.h * leaf.w)


def _values(coefficients: jax.Array, leaf: _Leaf) -> jax.Array:
    """The leaf whose blocks have the DCT ``coefficients`` ``(blocks, h·w)`` (the inverse DCT)."""
    dh, dw = (jnp.asarray(dct_matrix(n), F32) for n in (leaf.h, leaf.w))
    c = coefficients.reshape(leaf.rows // leaf.h, leaf.cols // leaf.w, leaf.h, leaf.w)
    x = jnp.einsum("yxbd,bi,dj->yixj", c, dh, dw, precision=HIGHEST)
    return x.reshape(leaf.shape)


def _encode(c: jax.Array, leaf: _Leaf) -> tuple[jax.Array, ...]:
    """The payload of the top-``k`` coefficients of each block: packed in-block indices (absent
    when a block has one coefficient) and float32 values, block after block."""
    _, idx = jax.lax.top_k(jnp.abs(c), leaf.k)
    values = jnp.take_along_axis(c, idx, axis=1).reshape(-1)
    if leaf.bits == 0:
        return (values,)
    return pack_bits(idx.reshape(-1).astype(jnp.uint32), leaf.bits), values


def _scatter(coefficients: jax.Array, payload: tuple[jax.Array, ...], leaf: _Leaf) -> jax.Array:
    """``coefficients`` ``(blocks, h·w)`` plus the sparse coefficients of one payload (its
    indices are distinct within a block, so the sum does not depend on the scatter's order)."""
    values = payload[-1].reshape(leaf.blocks, leaf.k)
    if leaf.bits == 0:
        return coefficients + values
    idx = unpack_bits(payload[0], leaf.bits, leaf.blocks * leaf.k).reshape(leaf.blocks, leaf.k)
    rows = jnp.broadcast_to(jnp.arange(leaf.blocks)[:, None], idx.shape)
    return coefficients.at[rows, idx.astype(jnp.int32)].add(values)


@configured("demo")
def demo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    comm: Communicator,
    momentum_decay: float = 0.999,
    chunk_size: int = 64,
    k: int = 32,
    sign: bool = True,
    weight_decay: float = 0.0,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    r"""DeMo (Decoupled Momentum Optimization): an optimizer whose replicas keep their own momentum
    and exchange only its largest DCT coefficients.

    A complete optimizer, like the reference's ``DeMo(torch.optim.SGD)``: it takes the raw local
    gradient (no all-reduce before it) and returns the parameter update. Replica :math:`i` of
    :math:`W`, with momentum :math:`m_i` (zero at ``init``), at step :math:`t`:

    .. math::
        m_i &\leftarrow \beta m_i + g_i \\
        q_i &= \mathrm{IDCT}\big(\mathrm{top}_k(\mathrm{DCT}(m_i))\big) \qquad
              \text{(per block)} \\
        m_i &\leftarrow m_i - q_i \\
        Q &= \tfrac1W \textstyle\sum_j q_j \\
        u &= -\eta_t \big(\mathrm{sign}(Q) + \lambda p\big) \qquad
              (\text{``sign=False``: } Q \text{ in place of } \mathrm{sign}(Q))

    :math:`\beta` is ``momentum_decay``, :math:`\eta_t` the learning rate, :math:`\lambda`
    ``weight_decay`` (decoupled, as the reference's ``p ← p (1 − η λ)``). Every leaf is viewed as
    a matrix (a vector as one row, a leaf of three or more axes as ``prod(leading axes) × last
    axis``) and cut into blocks of :math:`h \times w` values, :math:`h` and :math:`w` the largest
    divisors of the matrix's sides not above ``chunk_size`` (a side of at most ``chunk_size`` is
    one block). :math:`\mathrm{DCT}` is the orthonormal 2-D DCT-II of each block (a 1-D DCT for
    rows of one value), :math:`\mathrm{top}_k` keeps the :math:`\min(k, hw)` coefficients of
    largest magnitude of each block. :math:`Q` is identical on every replica, so the replicas'
    parameters stay identical; their momenta do not.

    Communication (every step): one all-gather of, per leaf with :math:`c` blocks,
    :math:`\lceil c k b / 8\rceil` bytes of in-block indices packed in
    :math:`b = \lceil\log_2 hw\rceil` bits and :math:`c k` float32 values. For a
    :math:`4096 \times 4096` kernel with the defaults (64 × 64 blocks, 32 of 4096 kept, 12-bit
    indices): 176 bytes per 4096 parameters, 93× less than a float32 all-reduce's payload. Ledger
    kind ``"all_gather[demo/<k>of<chunk_size>]"``.

    State: ``DemoState``; the step counter is replicated, the momentum per replica.

    Non-finite gradients (``nonfinite="skip"``, the default): a replica whose gradient has a
    non-finite element keeps its momentum and sends zeros (it still takes part in the all-gather,
    so no replica waits); the others' coefficients are averaged over :math:`W` as usual, and all
    replicas apply the same finite update. ``"ignore"``: no check (a NaN reaches every replica).

    Args:
      learning_rate: :math:`\eta`, a float or an optax schedule (the reference: 4e-4 for its 300M
        and 1B OLMo models, cosine with warm-up).
      comm: the group of replicas.
      momentum_decay: :math:`\beta` in [0, 1) (0.999).
      chunk_size: the largest block side (≥ 2; 64).
      k: coefficients kept per block, an int in [1, chunk_size²] (32: the reference's default and
        its OLMo configurations); clamped to a block's size.
      sign: step by :math:`\mathrm{sign}(Q)` (True, the reference) or by :math:`Q`.
      weight_decay: :math:`\lambda \ge 0`, decoupled (0.0); needs ``params`` in ``update``.
      nonfinite: ``"skip"`` or ``"ignore"``, see above.

    Example:
      >>> tx = optaxdist.demo(0.1, comm=comm, chunk_size=4, k=16)  # whole 4 × 4 blocks sent
      >>> g = jnp.stack([jnp.full((4, 4), i - 1.0) for i in range(4)])  # 4 replicas, mean 0.5
      >>> u = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="replica")(g)
      >>> u[0, 0]  # −lr · sign(mean)
      Array([-0.1, -0.1, -0.1, -0.1], dtype=float32)

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870, 2024.
      Reference implementation: github.com/bloc97/DeMo ``demo.py``.
    """
    check_comm("comm", comm)
    if not callable(learning_rate):
        check_number("learning_rate", learning_rate, 0, open_low=True, open_high=True)
    check_number("momentum_decay", momentum_decay, 0.0, 1.0, open_high=True)
    chunk_size = check_int("chunk_size", chunk_size, 2)
    k = check_int("k", k, 1, chunk_size * chunk_size + 1)
    check_bools(sign=sign)
    check_number("weight_decay", weight_decay, 0.0, open_high=True)
    check_nonfinite(nonfinite)
    kind = Kind("all_gather", f"demo/{k}of{chunk_size}")
    beta = float(momentum_decay)

    def plans(tree) -> list[_Leaf]:
        return [_leaf_plan(tuple(x.shape), chunk_size, k) for x in jax.tree.leaves(tree)]

    def init_fn(params):
        leaves = plans(params)
        payloads = [
            jax.eval_shape(
                lambda x, leaf=leaf: _encode(x, leaf),
                jax.ShapeDtypeStruct((leaf.blocks, leaf.h * leaf.w), F32),
            )
            for leaf in leaves
        ]
        return DemoState(
            demo_step=jnp.zeros((), jnp.int32),
            demo_momentum=per_replica(jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), F32), params), comm),
            demo_ledger=CommLedger.create({kind: payload_bytes(payloads)}),
        )

    def update_fn(updates, state, params=None, **extra):
        check_state("demo", state, DemoState)
        del extra
        if weight_decay and params is None:
            raise ValueError("demo(weight_decay>0) needs params in update")
        grads, treedef = jax.tree.flatten(updates)
        leaves = plans(updates)
        momenta = treedef.flatten_up_to(state.demo_momentum)
        ok = all_finite(grads) if nonfinite == "skip" else jnp.asarray(True)

        payloads, new_momenta = [], []
        for g, m, leaf in zip(grads, momenta, leaves):
            m = beta * m + g.astype(F32)
            if nonfinite == "skip":
                m = jnp.where(ok, m, 0.0)  # a skipped replica sends zeros
            payload = _encode(_coefficients(m, leaf), leaf)
            sent = _values(_scatter(jnp.zeros((leaf.blocks, leaf.h * leaf.w), F32), payload, leaf), leaf)
            payloads.append(payload)
            new_momenta.append(m - sent)
        if nonfinite == "skip":
            new_momenta = [jnp.where(ok, n, m) for n, m in zip(new_momenta, momenta)]

        gathered = comm.all_gather(payloads)
        count = state.demo_step
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        out = []
        for g, leaf, received, p in zip(
            grads, leaves, gathered, treedef.flatten_up_to(params) if params is not None else grads
        ):
            q = _values(_mean_coefficients(received, leaf, comm.size), leaf)
            u = jnp.sign(q) if sign else q
            if weight_decay:
                u = u + weight_decay * p.astype(F32)
            out.append((-jnp.asarray(lr, F32) * u).astype(g.dtype))

        return jax.tree.unflatten(treedef, out), DemoState(
            demo_step=optax.safe_increment(count),
            demo_momentum=per_replica(jax.tree.unflatten(treedef, new_momenta), comm),
            demo_ledger=state.demo_ledger.record(kind),
        )

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _mean_coefficients(received: tuple[jax.Array, ...], leaf: _Leaf, world: int) -> jax.Array:
    r"""The replicas' mean :math:`\frac1W \sum_j` of their sparse coefficients ``(blocks, h·w)``,
    added in replica order (scatters with distinct indices: the same bits on every replica)."""
    first = _scatter(jnp.zeros((leaf.blocks, leaf.h * leaf.w), F32), tuple(x[0] for x in received), leaf)
    total = jax.lax.fori_loop(
        1, world, lambda j, acc: _scatter(acc, tuple(x[j] for x in received), leaf), first
    )
    return total / jnp.float32(world)
