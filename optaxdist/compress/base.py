"""The compressor interface: pure encode/decode of one flat float32 vector. No communication here;
``compressed_allreduce`` moves the encodings with the communicator."""

from __future__ import annotations

import abc
import math
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist._validate import check_int

Payload = Any
Exchange = Literal["all_reduce", "all_gather", "two_phase"]


class Compressor(abc.ABC):
    """Encode a flat float32 vector into a small payload with static shapes.

    ``exchange`` says how replicas combine payloads:

    * ``"all_reduce"``: payloads are *linear* (the sum of encodings decodes to the sum of the
      decoded vectors), so they are summed with one all-reduce; ``combine`` decodes the sum and
      divides by the number of replicas.
    * ``"all_gather"``: every replica receives every payload (stacked on a leading axis) and
      ``combine`` merges them (sparse scatter-add, majority vote, ...).
    * ``"two_phase"`` (``quantize(exchange="two_phase")``): the payload is cut into one chunk per
      replica; an all-to-all brings replica ``j`` chunk ``j`` of every payload, which
      ``reduce_chunks`` averages and re-encodes; an all-gather of those, and ``decode_chunks``
      gives the mean. The compressor provides ``encode_chunks(x, world, key)``,
      ``reduce_chunks(received, chunk, key)`` and ``decode_chunks(payload, size)``; the
      transform runs the two collectives.

    ``decode`` gives the vector this replica's payload stands for: error feedback keeps
    ``x − decode(encode(x))`` as the residual.
    """

    exchange: ClassVar[Exchange] = "all_reduce"

    @property
    @abc.abstractmethod
    def name(self) -> str: ...

    @abc.abstractmethod
    def encode(self, x: jax.Array, key: jax.Array) -> Payload:
        """Payload of the float32 vector ``x``; ``key`` is identical on every replica."""

    @abc.abstractmethod
    def decode(self, payload: Payload, size: int, key: jax.Array) -> jax.Array:
        """The float32 vector of length ``size`` that ``payload`` stands for."""

    def combine(self, received: Payload, size: int, world: int, key: jax.Array) -> jax.Array:
        """Merge what the collective returned into the averaged float32 vector."""
        if self.exchange != "all_reduce":
            raise NotImplementedError(f"{type(self).__name__} must define combine")
        return self.decode(received, size, key) / jnp.float32(world)


def resolve_k(size: int, fraction: float | None, count: int | None) -> int:
    """Entries kept of a vector of ``size``: ``floor(fraction·size)`` or ``count``, within [1, size].

    Rounding down makes ``fraction`` an upper bound on the share sent (but for the minimum of one
    entry); SINGA rounds up.
    """
    k = math.floor(fraction * size) if fraction is not None else int(count)
    return max(1, min(size, k))


def check_fraction_or_count(
    fraction: float | None, count: int | None, prefix: str = ""
) -> tuple[float | None, int | None]:
    """Exactly one of ``{prefix}fraction`` (a real number in (0, 1]) and ``{prefix}count`` (an int
    ≥ 1) is given; returned as a Python float and int (a NumPy value configures as a Python one)."""
    if (fraction is None) == (count is None):
        raise ValueError(f"give exactly one of {prefix}fraction= (in (0, 1]) or {prefix}count= (an int ≥ 1)")
    if fraction is not None:
        value = _real(fraction)
        if value is None or not 0 < value <= 1:
            raise ValueError(f"{prefix}fraction={fraction!r} must be a real number in (0, 1]")
        return value, None
    return None, check_int(f"{prefix}count", count, 1)


def _real(x: Any) -> float | None:
    """A real scalar (Python, NumPy or JAX; not a bool) as the Python float its shortest decimal
    spells: ``np.float32(0.7)`` is 0.7, as written, not 0.699999988 (which keeps 699 of 1000)."""
    value = np.asarray(x)
    if value.ndim or not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
        return None
    return float(str(value[()]))


def scatter(indices: jax.Array, values: jax.Array, size: int) -> jax.Array:
    """Dense float32 vector with ``values`` added at ``indices`` (repeated indices add up)."""
    return jnp.zeros((size,), jnp.float32).at[indices.reshape(-1)].add(values.reshape(-1).astype(jnp.float32))
