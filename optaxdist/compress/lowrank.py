"""Low-rank compression by one step of power iteration (PowerSGD's compressor, pure: no
communication). ``optaxdist.transforms.powersgd`` runs it between its all-reduces."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist._compat import pcast_varying, varying_axes

F32 = jnp.dtype(jnp.float32)
HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class LowRankGroup:
    n: int
    m: int
    r: int
    dtype: jnp.dtype  # the gradient dtype of every member
    leaves: tuple[int, ...]  # indices into the flattened gradient leaves
    # under model sharding: the model axes that split the members' rows and their columns
    split: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())


@dataclasses.dataclass(frozen=True)
class LowRankPlan:
    """Static decisions, fixed by the leaves' shapes and dtypes: which leaves are compressed and
    how they are grouped, and which travel exactly."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[jnp.dtype, ...]
    groups: tuple[LowRankGroup, ...]
    exact: tuple[int, ...]  # uncompressed leaves (ndim ≤ 1, or failing the compression-rate test)

    def by_dtype(self, indices) -> dict[jnp.dtype, list[int]]:
        out: dict[jnp.dtype, list[int]] = {}
        for i in indices:
            out.setdefault(self.dtypes[i], []).append(i)
        return out

    def numel(self, i: int) -> int:
        return math.prod(self.shapes[i])


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The matrix view of a leaf: all axes but the last are rows, the last axis is the columns."""
    return math.prod(shape[:-1]), shape[-1]


def make_plan(
    leaves, rank: int, min_compression_rate: float, batch_same_shape: bool, splits=None
) -> LowRankPlan:
    """``splits``: per leaf, the model axes that split its matrix's rows and columns (members of a
    group share them); None: no model sharding."""
    splits = splits or [((), ())] * len(leaves)
    shapes = tuple(tuple(int(d) for d in x.shape) for x in leaves)
    dtypes = tuple(jnp.dtype(x.dtype) for x in leaves)
    groups: dict[Any, list] = {}
    exact = []
    for i, (shape, dt) in enumerate(zip(shapes, dtypes)):
        if len(shape) < 2 or not jnp.issubdtype(dt, jnp.floating):
            exact.append(i)
            continue
        n, m = matrix_shape(shape)
        r = min(n, m, rank)
        if not (n + m) * r * min_compression_rate < n * m:
            exact.append(i)
            continue
        key = (n, m, dt, splits[i]) if batch_same_shape else i
        groups.setdefault(key, [n, m, r, dt, [], splits[i]])[4].append(i)
    return LowRankPlan(
        shapes,
        dtypes,
        tuple(LowRankGroup(n, m, r, dt, tuple(ix), sp) for n, m, r, dt, ix, sp in groups.values()),
        tuple(exact),
    )


def draw_q(seed: int, leaf: int, step, m: int, r: int) -> jax.Array:
    """The random query of one leaf: a function of (seed, leaf index, step) only, identical on
    every replica."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), leaf), step)
    return jax.random.normal(key, (m, r), F32)


def initial_q(seed: int, group: LowRankGroup) -> np.ndarray:
    """The initial draw of a group, ``(B, m, r)`` float32 standard normal: a constant computed
    on the host from NumPy's legacy ``RandomState`` seeded with ``[seed, leaf index]``, whose
    stream NumPy keeps frozen across versions, so every replica draws the same bits."""
    return np.stack(
        [
            np.random.RandomState([seed, i]).standard_normal((group.m, group.r)).astype(np.float32)
            for i in group.leaves
        ]
    )


def orthonormalize(
    a: jax.Array, epsilon: float, sum_rows: Callable[[jax.Array], jax.Array] = lambda x: x
) -> tuple[jax.Array, jax.Array]:
    """Gram–Schmidt with re-orthogonalization on the columns of ``a`` (``(..., k, r)``, float32).

    Column ``i`` loses its projection on the finished columns ``0..i−1`` twice, then is divided by
    its norm if that norm exceeds ``epsilon`` and the second pass kept at least half of it;
    otherwise it becomes exactly zero (Kahan–Parlett "twice is enough": a column that loses more
    than half its norm in the second pass is rounding noise in the span of the previous columns).
    So the output columns are orthonormal to float32 precision or zero, never NaN, and ``A Aᵀ``
    is an orthogonal projection. ``sum_rows`` completes a sum over this block's rows into one over
    all of them, where the rows are split over model axes (a ``psum`` over them: ``r + 1`` scalars
    per column and pass).

    Returns:
      The orthonormalized ``a`` and a ``(..., r)`` bool array: which columns were kept (norm > ε).
    """
    r = a.shape[-1]

    def column(i, carry):
        out, kept = carry
        v = jax.lax.dynamic_index_in_dim(a, i, axis=-1, keepdims=False)
        norms = []
        for _ in range(2):  # columns ≥ i of ``out`` are still zero: they remove nothing
            coef = sum_rows(jnp.einsum("...kr,...k->...r", out, v, precision=HIGHEST))
            v = v - jnp.einsum("...kr,...r->...k", out, coef, precision=HIGHEST)
            norms.append(jnp.sqrt(sum_rows(jnp.sum(v * v, axis=-1, keepdims=True))))
        norm = norms[1]
        # Kahan–Parlett: a second pass that removes more than half the norm means the column was
        # rounding noise inside the span of the previous ones: it is dependent, drop it.
        ok = (norm > epsilon) & (norm >= 0.5 * norms[0])
        v = jnp.where(ok, v / jnp.where(ok, norm, 1.0), 0.0)
        out = jax.lax.dynamic_update_index_in_dim(out, v, i, axis=-1)
        kept = jax.lax.dynamic_update_index_in_dim(kept, ok, i, axis=-1)
        return out, kept

    init = vary_like((jnp.zeros_like(a), jnp.zeros(a.shape[:-2] + (r,), jnp.bool_)), (a, a))
    if r == 1:
        return column(0, init)
    return jax.lax.fori_loop(0, r, column, init)


def vary_like(new, old):
    """``new`` marked varying over the mesh axes over which ``old`` varies (shard_map types)."""
    return jax.tree.map(lambda n, o: pcast_varying(n, tuple(varying_axes(o))), new, old)
