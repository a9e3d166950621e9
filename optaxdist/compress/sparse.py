"""Sparsifiers: top-k, random-k, contiguous block-k and threshold."""

from __future__ import annotations

import abc
import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from optaxdist.compress.base import (
    Compressor,
    check_fraction_or_count,
    resolve_k,
    scatter,
)


@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
    """The ``k`` entries of largest magnitude, sent as (int32 index, float32 value) pairs."""

    fraction: float | None = None
    count: int | None = None
    exchange = "all_gather"

    def __post_init__(self):
        fraction, count = check_fraction_or_count(self.fraction, self.count)
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "count", count)

    @property
    def name(self) -> str:
        return "top_k"

    def encode(self, x, key):
        k = resolve_k(x.shape[0], self.fraction, self.count)
        _, idx = jax.lax.top_k(jnp.abs(x), k)
        return idx.astype(jnp.int32), x[idx]

    def decode(self, payload, size, key):
        return scatter(*payload, size)

    def combine(self, received, size, world, key):
        return scatter(*received, size) / jnp.float32(world)


@dataclasses.dataclass(frozen=True)
class _SharedIndices(Compressor):
    """Coordinates chosen from a key shared by all replicas: only the values travel (all-reduce)."""

    fraction: float | None = None
    count: int | None = None

    def __post_init__(self):
        fraction, count = check_fraction_or_count(self.fraction, self.count)
        object.__setattr__(self, "fraction", fraction)
        object.__setattr__(self, "count", count)

    @abc.abstractmethod
    def _indices(self, size: int, key: jax.Array) -> jax.Array:
        """The ``k`` coordinates of a vector of ``size``, identical on every replica for ``key``."""

    def encode(self, x, key):
        return x[self._indices(x.shape[0], key)]

    def decode(self, payload, size, key):
        return scatter(self._indices(size, key), payload, size)


class RandomK(_SharedIndices):
    """``k`` coordinates drawn uniformly without replacement from a key shared by all replicas:
    every replica picks the same coordinates, so only the values travel (one all-reduce)."""

    @property
    def name(self) -> str:
        return "random_k"

    def _indices(self, size, key):
        # The k largest of d uniform draws are a uniform k-subset; jax.random.choice(replace=False)
        # shuffles all d entries and is ~30x slower at d = 4M.
        k = resolve_k(size, self.fraction, self.count)
        return jax.lax.top_k(jax.random.uniform(key, (size,)), k)[1].astype(jnp.int32)


class BlockK(_SharedIndices):
    """A contiguous block of ``k`` coordinates starting at a shared random offset, wrapping around
    the end, so every coordinate is selected equally often (mlbench's blockwise sparsifier never
    selects the last ``d mod k``). Only the values travel (one all-reduce)."""

    @property
    def name(self) -> str:
        return "block_k"

    def _indices(self, size, key):
        k = resolve_k(size, self.fraction, self.count)
        start = jax.random.randint(key, (), 0, size, jnp.int32)
        return (start + jnp.arange(k, dtype=jnp.int32)) % size


@dataclasses.dataclass(frozen=True)
class Threshold(Compressor):
    """Entries with ``|x| ≥ tau`` (SINGA's threshold mode).

    Two ways to keep shapes static:

    * ``mode="dense"`` (default): all-reduce the masked dense vector. The reduced values equal a
      sparse exchange's; the bytes are those of a dense all-reduce (an emulation: use it to study
      convergence, not to save bandwidth).
    * ``mode="padded"``: all-gather (index, value) pairs padded to a static bound of
      ``max_fraction``/``max_count`` entries. If more entries pass the threshold, the largest are
      sent and the rest stay in the error-feedback residual.
    """

    tau: float = 0.0
    mode: Literal["dense", "padded"] = "dense"
    max_fraction: float | None = None
    max_count: int | None = None

    def __post_init__(self):
        if not self.tau >= 0:
            raise ValueError(f"tau={self.tau!r} must be ≥ 0")
        if self.mode not in ("dense", "padded"):
            raise ValueError(f"mode={self.mode!r}; allowed: 'dense', 'padded'")
        if self.mode == "padded":
            fraction, count = check_fraction_or_count(self.max_fraction, self.max_count, "max_")
            object.__setattr__(self, "max_fraction", fraction)
            object.__setattr__(self, "max_count", count)
        elif self.max_fraction is not None or self.max_count is not None:
            raise ValueError("max_fraction / max_count apply only to mode='padded'")
        object.__setattr__(self, "exchange", "all_gather" if self.mode == "padded" else "all_reduce")

    @property
    def name(self) -> str:
        return f"threshold_{self.mode}"

    def encode(self, x, key):
        keep = jnp.abs(x) >= self.tau
        if self.mode == "dense":
            return jnp.where(keep, x, 0.0)
        bound = resolve_k(x.shape[0], self.max_fraction, self.max_count)
        _, idx = jax.lax.top_k(jnp.where(keep, jnp.abs(x), -1.0), bound)
        return idx.astype(jnp.int32), jnp.where(keep[idx], x[idx], 0.0)

    def decode(self, payload, size, key):
        return payload if self.mode == "dense" else scatter(*payload, size)

    def combine(self, received, size, world, key):
        summed = received if self.mode == "dense" else scatter(*received, size)
        return summed / jnp.float32(world)


def top_k(*, fraction: float | None = None, count: int | None = None) -> TopK:
    """True magnitude top-k (SINGA's comparator truncated to int; this one does not)."""
    return TopK(fraction, count)


def random_k(*, fraction: float | None = None, count: int | None = None) -> RandomK:
    """Random-k with indices from a key shared by all replicas (no indices on the wire)."""
    return RandomK(fraction, count)


def block_k(*, fraction: float | None = None, count: int | None = None) -> BlockK:
    """A contiguous, wrapping block of k coordinates at a shared random offset."""
    return BlockK(fraction, count)


def threshold(
    tau: float,
    *,
    mode: Literal["dense", "padded"] = "dense",
    max_fraction: float | None = None,
    max_count: int | None = None,
) -> Threshold:
    """Entries with ``|x| ≥ tau``; see ``Threshold`` for the dense and padded exchanges."""
    return Threshold(tau, mode, max_fraction, max_count)
