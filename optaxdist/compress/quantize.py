"""Block-wise quantization: integers of 8, 4 or 2 bits or 8-bit floats (e4m3, e5m2) per value, one
float32 scale (or a table of bin values) per block, values bit-packed on the wire."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from optaxdist._validate import is_int
from optaxdist.comm.base import sum_in_member_order
from optaxdist.compress.base import Compressor, Payload

BITS = (2, 4, 8)
ROUNDINGS = ("nearest", "stochastic")
EXCHANGES = ("all_gather", "two_phase")
SCALES = ("absmax", "sigma")
FORMATS = ("int", "e4m3", "e5m2")
FLOAT8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}  # e4m3: OCP's finite-only variant


@dataclasses.dataclass(frozen=True)
class Quantize(Compressor):
    r"""Block-wise quantization with ``bits`` per value: symmetric integers times a scale
    (``scale="absmax"``, the default) or SparseLoCo's σ bins (``scale="sigma"``, below).

    The vector is cut into blocks of ``block_size`` values (the last one zero-padded). Block
    :math:`b` gets the scale :math:`s_b = \max_{i \in b} |x_i| \cdot \mathrm{fl}(1/q)` with
    :math:`q = 2^{\text{bits}-1} - 1` (127, 7, 1) and each value the integer
    :math:`n_i = \mathrm{round}(x_i \cdot \mathrm{fl}(1/s_b)) \in [-q, q]`, stored as ``n + q`` in
    ``bits`` bits, ``8 / bits`` values per byte. ``decode`` is :math:`\mathrm{fl}(n_i s_b)`: the
    error is at most :math:`s_b / 2` (``"nearest"``) or below :math:`s_b` (``"stochastic"``: round
    up with probability the fractional part: unbiased. The random offsets come from the step's key,
    which every replica shares, so the replicas' rounding errors are correlated and do not shrink
    as ``1/W`` in the average). A non-finite value makes its block decode to NaN on every replica,
    as a plain all-reduce would propagate it (``dynamic_loss_scale`` skips such steps).

    The arithmetic is written as XLA runs it, so that a NumPy model gives the same bits: XLA
    divides by a constant or a broadcast value as a product with the reciprocal (written out
    here), and contracts a product followed by a sum into a fused multiply-add, so ``decode``
    computes :math:`n_i s_b` as :math:`n_i s_b^{hi} + n_i s_b^{lo}` (``s_hi``: the top 17
    significant bits of the scale), two exact products whose sum is :math:`\mathrm{fl}(n_i s_b)`
    with or without a fused multiply-add, before or after.

    **8-bit floats** (``format="e4m3"`` or ``"e5m2"``, ``bits=8``: torchft's row-wise fp8, here per
    block). The scale maps the block's largest magnitude to the format's largest finite value
    :math:`m` (448 for e4m3, 57344 for e5m2): :math:`s_b = \max_{i \in b} |x_i| \cdot
    \mathrm{fl}(1/m)`, and each value is :math:`f_i = \mathrm{fp8}(x_i \cdot \mathrm{fl}(1/s_b))`,
    clipped to :math:`[-m, m]` and rounded to the nearest 8-bit float (half to even), or
    stochastically to one of its two neighbours on the 8-bit grid (with probability by distance:
    unbiased). One byte per value (its bit pattern), one float32 scale per block, as int8. For a
    value whose scaled magnitude is a normal 8-bit float, the relative error is at most half an
    ulp with ``"nearest"``, :math:`2^{-4}` (e4m3) or :math:`2^{-3}` (e5m2), and below one ulp with
    ``"stochastic"``; below the smallest normal, the subnormal spacing times the scale bounds the
    absolute error. Against int8's :math:`s_b/2` absolute: better for blocks of mixed magnitudes,
    worse for uniform ones. Decoding :math:`f_i s_b` is bit-exact as long as nothing underflows:
    for scales below about 1e-27 (e5m2) or 1e-29 (e4m3) the low product of the smallest values can
    fall below float32's normals, which XLA flushes to zero (an error of a float32 ulp), and a
    block whose largest magnitude is below about 1e-36 (e4m3) or 1e-34 (e5m2) decodes to zeros
    (the reciprocal of its scale overflows).
    Ledger kind ``all_gather[e4m3/<block_size>]``. Both exchanges.

    Two exchanges (``exchange``):

    * ``"all_gather"``: every replica all-gathers every payload (integers of different scales do
      not add) and averages the ``W`` decoded vectors in float32. It receives ``W`` payloads:
      int8 at ``W`` replicas sends ``(W − 1)·P`` with ``P ≈ d/4`` float32-equivalents, more than
      a float32 ring all-reduce (``2(W − 1)/W · 4d`` bytes) beyond 8 replicas (int4: 16, int2: 32).
    * ``"two_phase"`` (EQuARX, torchft): the vector is zero-padded to ``W`` chunks of
      ``L = ⌈⌈d/W⌉/B⌉·B`` values (whole blocks) and quantized; an **all-to-all** gives replica
      :math:`j` chunk :math:`j` of every payload; it decodes them, adds them in float32 in member
      order (replica 0 first) and re-quantizes the mean
      :math:`\bar c_j = \mathrm{fl}(\sum_i D(C(v_i)_j) \cdot \mathrm{fl}(1/W))`; an **all-gather**
      of the re-quantized chunks gives everyone :math:`D(C(\bar c_0)), \dots, D(C(\bar c_{W-1}))`,
      the mean (padding cut). Per member and step, with ``P = W·L·bits/8 + 4·W·L/B`` bytes (the
      padded payload): the all-to-all sends :math:`(W-1)/W \cdot P`, the all-gather
      :math:`(W-1) \cdot P/W`: :math:`2(W-1)/W \cdot P` in all, the bytes of a ring all-reduce of
      the quantized vector, ``W/2`` times less than the all-gather for ``W`` large (it beats it
      for ``W > 2``; the float32 ring all-reduce of ``4d`` bytes by ``≈ 4d / P``: ``≈ 3.8×`` at
      int8/64). The second quantization adds an error of at most half a scale of the mean's
      blocks, which error feedback does not see (below). With ``rounding="stochastic"`` the
      re-quantization's key is the step's key folded with the chunk index.

    Payload per vector of ``d`` values: ``ceil(d / block_size)`` float32 scales and
    ``ceil(d / block_size) · block_size · bits / 8`` bytes of packed values; ledger kind
    ``all_gather[int<bits>/<block_size>]``. Two-phase: ``all_to_all[int<bits>/<block_size>]`` with
    the whole padded payload ``P`` of this replica, and ``all_gather[int<bits>/<block_size>]``
    with one re-quantized chunk, ``P / W``. With ``scope="leaf"`` every leaf is padded on its own.

    Error feedback (``compressed_allreduce``) keeps what this replica's own (first) quantization
    lost, :math:`v - D(C(v))`; the error of the re-quantization of the mean is not fed back (it
    belongs to no single replica), so the two-phase average is biased by at most half a scale of
    the mean's blocks per step.

    **σ bins** (``scale="sigma"``: SparseLoCo's quantizer, after Templar's ``TopKCompressor``,
    there per tensor and here per block). Block :math:`b` of :math:`n_b` values (its padding left
    out) gets its mean :math:`\mu_b`, its sample standard deviation
    :math:`\sigma_b = \sqrt{\sum_i (x_i - \mu_b)^2 / \max(n_b - 1, 1)}` and the step
    :math:`s_b = \text{sigmas} \cdot \sigma_b / L` with :math:`L = 2^{\text{bits}}` bins (1 if
    that is 0 or not finite). Value :math:`i` goes to bin
    :math:`n_i = \mathrm{clip}(\mathrm{round}((x_i - \mu_b)/s_b) + L/2,\ 0,\ L - 1)`
    (``"stochastic"``: ``floor(· + u)``), stored in ``bits`` bits: every code is a level, none is
    reserved for zero. At 2 bits (the paper's "4 bins over 6σ") the bins are 1.5σ wide, centred
    on :math:`\mu_b - 3\sigma_b, \mu_b - 1.5\sigma_b, \mu_b, \mu_b + 1.5\sigma_b`, the two outer ones
    open. Each block sends a table of :math:`L` float32 values and ``decode`` is the table entry
    of the code (a lookup, no arithmetic):

    * ``"nearest"``: the bin **centroids** :math:`t_{b,j}`, the mean of the block's values in bin
      :math:`j` (0 for an empty bin), as Templar does. A value's error is at most the spread of its
      bin's values: below :math:`s_b` in the :math:`L - 2` inner bins, and in the outer bins (which
      also take everything beyond the range) the distance to their mean. Each bin's sum, hence the
      block's, is kept up to rounding: nothing is lost on average, only spread within a bin.
    * ``"stochastic"``: the bin **centres** :math:`\mu_b + (j - L/2)\,s_b`: unbiased with an error
      below :math:`s_b` for values in :math:`[\mu_b - (L/2) s_b,\ \mu_b + (L/2 - 1) s_b]`,
      clipped beyond.

    The centroid sums are a scatter-add (its rounding may depend on the order on a GPU); the
    sender computes the table once and every replica decodes the same table. Payload per vector:
    ``ceil(d / block_size) · block_size · bits / 8`` bytes of codes and ``4 · L`` bytes of table
    per block (2 bits: 16 bytes per block; 8 bits: 1 KiB per block, so large blocks only); ledger
    kind ``all_gather[int<bits>/<block_size>,sigma<sigmas>]``. Only ``exchange="all_gather"``.
    """

    bits: int = 8
    block_size: int = 64
    rounding: str = "nearest"
    exchange: str = "all_gather"
    scale: str = "absmax"
    sigmas: float = 6.0
    format: str = "int"

    def __post_init__(self):
        if not is_int(self.bits) or self.bits not in BITS:
            raise ValueError(f"bits={self.bits!r}; allowed: {BITS}")
        size = self.block_size
        if not is_int(size) or size < 1 or size % (8 // self.bits):
            raise ValueError(
                f"block_size={self.block_size!r} must be an int ≥ 1 and a multiple of "
                f"{8 // self.bits} (the values in one byte at bits={self.bits})"
            )
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding={self.rounding!r}; allowed: {ROUNDINGS}")
        if self.exchange not in EXCHANGES:
            raise ValueError(f"exchange={self.exchange!r}; allowed: {EXCHANGES}")
        if self.scale not in SCALES:
            raise ValueError(f"scale={self.scale!r}; allowed: {SCALES}")
        sigmas = self.sigmas
        if isinstance(sigmas, bool) or not isinstance(sigmas, (int, float)) or not 0 < sigmas < math.inf:
            raise ValueError(f"sigmas={sigmas!r} must be a finite number > 0 (the range of the bins in σ)")
        if self.scale == "absmax" and sigmas != 6.0:
            raise ValueError(f"sigmas={sigmas!r} applies to scale='sigma' only")
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r}; allowed: {FORMATS}")
        object.__setattr__(self, "bits", int(self.bits))  # a NumPy int configures as a Python one
        object.__setattr__(self, "block_size", int(size))
        if self.format != "int" and (self.bits != 8 or self.scale != "absmax"):
            raise ValueError(
                f"format={self.format!r} is an 8-bit float with one scale per block: it needs bits=8 "
                f"and scale='absmax', got bits={self.bits!r}, scale={self.scale!r}"
            )
        if self.scale == "sigma" and self.exchange != "all_gather":
            raise ValueError(
                f"scale='sigma' with exchange={self.exchange!r}: σ bins support exchange='all_gather' only"
            )

    @property
    def name(self) -> str:
        sigma = f",sigma{self.sigmas:g}" if self.scale == "sigma" else ""
        suffix = "" if self.rounding == "nearest" else ",stochastic"
        code = f"int{self.bits}" if self.format == "int" else self.format
        return f"{code}/{self.block_size}{sigma}{suffix}"

    @property
    def levels(self) -> int | float:
        """q: the integers are in [−q, q] (``scale="absmax"``); with an 8-bit float format, the
        format's largest finite value."""
        if self.format != "int":
            return float(jnp.finfo(FLOAT8[self.format]).max)
        return 2 ** (self.bits - 1) - 1

    @property
    def bins(self) -> int:
        """L = 2^bits: the bins of ``scale="sigma"``, and the float32 entries of a block's table."""
        return 2**self.bits

    def _blocks(self, x: jax.Array) -> jax.Array:
        num = math.ceil(x.shape[0] / self.block_size)
        return jnp.pad(x, (0, num * self.block_size - x.shape[0])).reshape(num, self.block_size)

    def encode(self, x, key):
        if self.scale == "sigma":
            return self._encode_sigma(x, key)
        blocks = self._blocks(x.astype(jnp.float32))
        q = self.levels
        scale = jnp.max(jnp.abs(blocks), axis=1) * jnp.float32(1 / q)
        inverse = jnp.float32(1) / jnp.where(scale > 0, scale, jnp.float32(1))
        scaled = blocks * inverse[:, None]
        if self.format != "int":
            return self._float8_codes(scaled, key), scale
        if self.rounding == "nearest":
            ints = jnp.round(scaled)
        else:
            ints = jnp.floor(scaled + jax.random.uniform(key, scaled.shape, jnp.float32))
        # a non-finite value codes as 0; its block's non-finite scale makes the block decode to NaN
        ints = jnp.where(jnp.isfinite(scaled), ints, 0.0)
        codes = (jnp.clip(ints, -q, q) + q).astype(jnp.uint8).reshape(-1)
        return _pack(codes, self.bits), scale

    def decode(self, payload, size, key):
        return self._decode(payload)[:size]

    def _float8_codes(self, scaled: jax.Array, key) -> jax.Array:
        """The bit patterns (uint8) of ``scaled`` (in [−m, m] up to rounding) as 8-bit floats,
        rounded to nearest or stochastically; a non-finite value codes as 0 (its block's scale is
        not finite, so it decodes to NaN)."""
        fp8, top = FLOAT8[self.format], jnp.float32(self.levels)
        x = jnp.where(jnp.isfinite(scaled), jnp.clip(scaled, -top, top), jnp.float32(0))
        if self.rounding == "stochastic":
            # the magnitude's neighbours on the 8-bit grid: bit patterns of one sign are ordered
            magnitude = jnp.abs(x)
            near = jax.lax.bitcast_convert_type(magnitude.astype(fp8), jnp.uint8)
            near_value = jax.lax.bitcast_convert_type(near, fp8).astype(jnp.float32)
            low = jnp.where(near_value > magnitude, near - jnp.uint8(1), near)
            low_value = jax.lax.bitcast_convert_type(low, fp8).astype(jnp.float32)
            high = jnp.where(low_value < magnitude, low + jnp.uint8(1), low)
            high_value = jax.lax.bitcast_convert_type(high, fp8).astype(jnp.float32)
            gap = high_value - low_value
            up = jax.random.uniform(key, x.shape, jnp.float32) * gap < magnitude - low_value
            codes = jnp.where(up, high, low) | jnp.where(x < 0, jnp.uint8(0x80), jnp.uint8(0))
            return codes.reshape(-1)
        return jax.lax.bitcast_convert_type(x.astype(fp8), jnp.uint8).reshape(-1)

    def _encode_sigma(self, x, key):
        """Codes and per-block tables of ``scale="sigma"`` (see the class)."""
        size = x.shape[0]
        blocks = self._blocks(x.astype(jnp.float32))
        num, width = blocks.shape
        bins, half = self.bins, self.bins // 2
        counts = np.full(num, width, np.float32)  # values per block, the last one's padding left out
        counts[-1] = size - (num - 1) * width
        valid = jnp.asarray((np.arange(num * width) < size).reshape(num, width))
        finite = jnp.all(jnp.isfinite(blocks), axis=1)
        mean = jnp.sum(blocks, axis=1) / jnp.asarray(counts)
        centred = jnp.where(valid, blocks - mean[:, None], jnp.float32(0))
        variance = jnp.sum(centred * centred, axis=1) / jnp.asarray(np.maximum(counts - 1, 1))
        step = jnp.sqrt(variance) * jnp.float32(self.sigmas / bins)
        step = jnp.where((step > 0) & jnp.isfinite(step), step, jnp.float32(1))
        scaled = centred * (jnp.float32(1) / step)[:, None]
        if self.rounding == "nearest":
            ints = jnp.round(scaled)
        else:
            ints = jnp.floor(scaled + jax.random.uniform(key, scaled.shape, jnp.float32))
        ints = jnp.where(jnp.isfinite(scaled), ints, 0.0)
        codes = (jnp.clip(ints, -half, half - 1) + half).astype(jnp.int32)
        if self.rounding == "nearest":  # the mean of each bin's values
            segments = (jnp.arange(num, dtype=jnp.int32)[:, None] * bins + codes).reshape(-1)
            kept = jnp.where(valid, blocks, jnp.float32(0)).reshape(-1)
            sums = jax.ops.segment_sum(kept, segments, num * bins).reshape(num, bins)
            members = jax.ops.segment_sum(valid.reshape(-1).astype(jnp.float32), segments, num * bins)
            members = members.reshape(num, bins)
            table = sums / jnp.where(members > 0, members, jnp.float32(1))
        else:  # the bin centres
            offsets = jnp.arange(bins, dtype=jnp.float32) - jnp.float32(half)
            table = mean[:, None] + offsets[None, :] * step[:, None]
        table = jnp.where(finite[:, None], table, jnp.float32(jnp.nan))
        return _pack(codes.astype(jnp.uint8).reshape(-1), self.bits), table.reshape(-1)

    def _decode(self, payload) -> jax.Array:
        """The float32 values of the payload(s), padding included; any leading axes (a stack)."""
        if self.scale == "sigma":
            packed, table = payload
            num = table.shape[-1] // self.bins
            lead = table.shape[:-1]
            codes = _unpack(packed, self.bits, num * self.block_size).astype(jnp.int32)
            codes = codes.reshape(*lead, num, self.block_size)
            values = jnp.take_along_axis(table.reshape(*lead, num, self.bins), codes, axis=-1)
            return values.reshape(*lead, num * self.block_size)
        packed, scale = payload
        num = scale.shape[-1]
        codes = _unpack(packed, self.bits, num * self.block_size)
        if self.format == "int":
            ints = codes.astype(jnp.float32) - jnp.float32(self.levels)
            # n·s as two exact products (|n| < 2^7, s_hi of 17 significant bits, s_lo of the
            # other 7): the same bits whether or not XLA fuses a product with an add around it
            mask = jnp.uint32(0xFFFFFF80)
        else:  # an 8-bit float has at most 4 significant bits: s_hi of 20 bits, s_lo of 4
            ints = jax.lax.bitcast_convert_type(codes, FLOAT8[self.format]).astype(jnp.float32)
            mask = jnp.uint32(0xFFFFFFF0)
        ints = ints.reshape(*codes.shape[:-1], num, self.block_size)
        high = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(scale, jnp.uint32) & mask, jnp.float32
        )
        values = ints * high[..., None] + ints * (scale - high)[..., None]
        return values.reshape(*codes.shape[:-1], num * self.block_size)

    def combine(self, received, size, world, key):
        return jnp.mean(self._decode(received)[..., :size], axis=0)

    # ---- the two-phase exchange (exchange="two_phase") ---------------------------------------

    def chunk_size(self, size: int, world: int) -> int:
        """``L``: values per chunk of a vector of ``size`` cut into ``world`` chunks of whole blocks."""
        return math.ceil(math.ceil(size / world) / self.block_size) * self.block_size

    def encode_chunks(self, x: jax.Array, world: int, key: jax.Array) -> Payload:
        """The payload of ``x`` zero-padded to ``world`` chunks, one row per chunk (the all-to-all's
        buffer: row ``j`` goes to replica ``j``)."""
        padded = jnp.pad(x, (0, world * self.chunk_size(x.shape[0], world) - x.shape[0]))
        packed, scale = self.encode(padded, key)
        return packed.reshape(world, -1), scale.reshape(world, -1)

    def reduce_chunks(self, received: Payload, chunk: jax.Array | int, key: jax.Array) -> Payload:
        """The mean of the ``W`` encodings of chunk ``chunk`` (row ``i``: replica ``i``'s), added in
        float32 in member order and re-quantized: this replica's share of the all-gather."""
        world = received[1].shape[0]
        mean = sum_in_member_order(self._decode(received)) * jnp.float32(1 / world)
        return self.encode(mean, jax.random.fold_in(key, chunk))

    def decode_chunks(self, payload: Payload, size: int) -> jax.Array:
        """The vector of ``size`` values whose chunks are the rows of ``payload`` (padding cut)."""
        return self._decode(payload).reshape(-1)[:size]


def _pack(codes: jax.Array, bits: int) -> jax.Array:
    """``8 / bits`` codes of ``bits`` bits per byte, the first in the low bits."""
    if bits == 8:
        return codes
    per = 8 // bits
    groups = codes.reshape(-1, per).astype(jnp.uint32)
    shifts = jnp.arange(per, dtype=jnp.uint32) * jnp.uint32(bits)
    return jnp.sum(groups << shifts, axis=1).astype(jnp.uint8)


def _unpack(packed: jax.Array, bits: int, count: int) -> jax.Array:
    """The ``count`` codes of ``packed`` (any leading axes)."""
    if bits == 8:
        return packed[..., :count]
    per = 8 // bits
    shifts = jnp.arange(per, dtype=jnp.uint8) * jnp.uint8(bits)
    codes = (packed[..., None] >> shifts) & jnp.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * per)[..., :count]


def quantize(
    bits: int = 8,
    *,
    block_size: int = 64,
    rounding: str = "nearest",
    exchange: str = "all_gather",
    scale: str = "absmax",
    sigmas: float = 6.0,
    format: str = "int",
) -> Quantize:
    """Block-wise ``bits``-bit quantization (8, 4 or 2) with a float32 scale per ``block_size``
    values, or with SparseLoCo's σ bins and a table of bin values per block, or to 8-bit floats
    with a scale per block (see ``Quantize``).

    Args:
      bits: 8, 4 or 2 bits per value.
      block_size: values per float32 scale; a multiple of ``8 / bits``.
      rounding: ``"nearest"`` (half to even) or ``"stochastic"`` (unbiased, from the replicas'
        shared key).
      exchange: ``"all_gather"`` (every replica receives every payload) or ``"two_phase"``
        (all-to-all of chunks, mean and re-quantization per chunk, all-gather: the bytes of a ring
        all-reduce of the payload; for a flat group: ``AxisComm``, ``MpiComm``).
      scale: ``"absmax"`` (symmetric integers in [−q, q] times the block's largest magnitude
        over q) or ``"sigma"`` (``2^bits`` bins of ``sigmas·σ / 2^bits`` around the block's mean,
        decoded to the bins' centroids (``"nearest"``) or centres (``"stochastic"``); SparseLoCo's
        2-bit quantizer; ``exchange="all_gather"`` only).
      sigmas: with ``scale="sigma"``, the width of the bins' range in standard deviations (6).
      format: ``"int"`` (integers), or an 8-bit float, ``"e4m3"`` (``float8_e4m3fn``: 4 exponent
        bits, 3 mantissa bits, no infinities) or ``"e5m2"``, scaled per block so that the largest
        magnitude is the format's largest value; needs ``bits=8`` and ``scale="absmax"``.

    Example:
      >>> tx = optaxdist.compressed_allreduce(
      ...     optaxdist.compress.quantize(8, exchange="two_phase"), comm=comm)
    """
    return Quantize(bits, block_size, rounding, exchange, scale, sigmas, format)
