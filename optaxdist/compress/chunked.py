"""Chunked top-k: the ``k`` largest entries of every chunk, in-chunk indices bit-packed, values in
float32 or quantized (SparseLoCo's encoding)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from optaxdist._validate import check_int, is_int
from optaxdist.compress.base import Compressor, scatter
from optaxdist.compress.quantize import Quantize


@dataclasses.dataclass(frozen=True)
class ChunkedTopK(Compressor):
    r"""Top-``k`` of every chunk of ``chunk_size`` values, indices packed in ``ceil(log2 chunk_size)``
    bits each, values in float32 or quantized by ``values``.

    The vector is cut into :math:`c = \lceil d / \text{chunk\_size} \rceil` chunks (the last one
    zero-padded); in each, the ``k`` entries of largest magnitude are kept. An index within its
    chunk needs :math:`b = \lceil \log_2 \text{chunk\_size} \rceil` bits (12 for 4096); all
    :math:`c k` indices are packed back to back into :math:`\lceil c k b / 8 \rceil` bytes. The
    :math:`c k` kept values, chunk after chunk, travel as float32 or, with ``values`` (a
    ``quantize(...)`` whose ``block_size`` divides ``k``, so that no block straddles two chunks),
    as its payload: ``quantize(2, block_size=k)`` gives one scale per chunk. Replicas all-gather
    their payloads (each replica keeps its own indices) and ``combine`` adds the decoded vectors
    and divides by the number of replicas. ``decode`` is the sparse vector actually sent (with the
    values as quantized), so error feedback keeps what quantization lost as well.

    Payload per vector of ``d`` values: :math:`\lceil c k b / 8 \rceil` bytes of indices plus
    :math:`4 c k` bytes of values, or ``values``' payload of :math:`c k` values; ledger kind
    ``all_gather[chunked_top_k/<k>of<chunk_size>[,<values>]]``. SparseLoCo's setting (64 of every
    4096, 2-bit values in 4 bins over 6σ, ``optaxdist.sparseloco``'s default) is
    ``chunked_top_k(4096, 64, values=quantize(2, block_size=64, scale="sigma"))``: 96 bytes of
    indices, 16 of values and a table of 4 float32 centroids, 128 bytes per 4096 float32 values
    (16 KiB), 128× less; with ``quantize(2, block_size=64)`` (one scale per chunk) 116 bytes, 141×.
    """

    chunk_size: int = 4096
    k: int = 64
    values: Quantize | None = None
    exchange = "all_gather"

    def __post_init__(self):
        size = check_int("chunk_size", self.chunk_size, 2)
        if not is_int(self.k) or not 1 <= self.k <= size:
            raise ValueError(f"k={self.k!r} must be an int in [1, chunk_size={size}]")
        object.__setattr__(self, "chunk_size", size)  # a NumPy int configures as a Python one
        object.__setattr__(self, "k", int(self.k))
        if self.values is not None:
            if not isinstance(self.values, Quantize):
                raise TypeError(
                    f"values must be None (float32) or optaxdist.compress.quantize(...), got {self.values!r}"
                )
            if self.values.exchange != "all_gather":
                raise ValueError(
                    f"values=quantize(..., exchange={self.values.exchange!r}): the kept values are encoded "
                    "inside the chunked payload, so values must use the default exchange='all_gather'"
                )
            if self.k % self.values.block_size:
                raise ValueError(
                    f"values.block_size={self.values.block_size} must divide k={self.k}: a quantization "
                    "block must not straddle two chunks"
                )

    @property
    def name(self) -> str:
        suffix = "" if self.values is None else f",{self.values.name}"
        return f"chunked_top_k/{self.k}of{self.chunk_size}{suffix}"

    @property
    def index_bits(self) -> int:
        """Bits of one in-chunk index: ``ceil(log2(chunk_size))``."""
        return math.ceil(math.log2(self.chunk_size))

    def _chunks(self, size: int) -> int:
        return math.ceil(size / self.chunk_size)

    def encode(self, x, key):
        num = self._chunks(x.shape[0])
        chunks = jnp.pad(x.astype(jnp.float32), (0, num * self.chunk_size - x.shape[0]))
        chunks = chunks.reshape(num, self.chunk_size)
        _, idx = jax.lax.top_k(jnp.abs(chunks), self.k)
        kept = jnp.take_along_axis(chunks, idx, axis=1).reshape(-1)
        indices = pack_bits(idx.reshape(-1).astype(jnp.uint32), self.index_bits)
        return indices, kept if self.values is None else self.values.encode(kept, key)

    def _positions_and_values(self, payload, size: int, key) -> tuple[jax.Array, jax.Array]:
        """Positions in the padded vector and float32 values of one payload."""
        packed, kept = payload
        num = self._chunks(size)
        idx = unpack_bits(packed, self.index_bits, num * self.k).reshape(num, self.k)
        offsets = jnp.arange(num, dtype=jnp.uint32)[:, None] * jnp.uint32(self.chunk_size)
        values = kept if self.values is None else self.values.decode(kept, num * self.k, key)
        return (idx + offsets).reshape(-1).astype(jnp.int32), values

    def decode(self, payload, size, key):
        positions, values = self._positions_and_values(payload, size, key)
        return scatter(positions, values, self._chunks(size) * self.chunk_size)[:size]

    def combine(self, received, size, world, key):
        positions, values = jax.vmap(lambda p: self._positions_and_values(p, size, key))(received)
        summed = scatter(positions, values, self._chunks(size) * self.chunk_size)[:size]
        return summed / jnp.float32(world)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
    """The ``bits`` low bits of each of ``codes`` (uint32) back to back, first code in the low
    bits of the first byte: ``ceil(len · bits / 8)`` bytes."""
    flat = ((codes[:, None] >> jnp.arange(bits, dtype=jnp.uint32)) & jnp.uint32(1)).reshape(-1)
    flat = jnp.pad(flat, (0, -flat.shape[0] % 8)).astype(jnp.uint8).reshape(-1, 8)
    return jnp.sum(flat << jnp.arange(8, dtype=jnp.uint8), axis=1, dtype=jnp.uint8)


def unpack_bits(packed: jax.Array, bits: int, count: int) -> jax.Array:
    """The first ``count`` codes of ``bits`` bits each of ``packed`` (uint32)."""
    flat = ((packed[:, None] >> jnp.arange(8, dtype=jnp.uint8)) & jnp.uint8(1)).reshape(-1)
    codes = flat[: count * bits].astype(jnp.uint32).reshape(count, bits)
    return jnp.sum(codes << jnp.arange(bits, dtype=jnp.uint32), axis=1, dtype=jnp.uint32)


def chunked_top_k(chunk_size: int = 4096, k: int = 64, *, values: Quantize | None = None) -> ChunkedTopK:
    """Top-``k`` of every ``chunk_size`` values with bit-packed in-chunk indices and float32 or
    ``quantize(...)``-d values (SparseLoCo: ``chunked_top_k(4096, 64, values=quantize(2,
    block_size=64, scale="sigma"))``)."""
    return ChunkedTopK(chunk_size, k, values)
