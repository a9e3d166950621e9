"""1-bit signs: signSGD with majority vote, and EF-signSGD's scaled sign."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from optaxdist.compress.base import Compressor


def _pack(x: jax.Array) -> jax.Array:
    return jnp.packbits(x >= 0)


def _unpack(bits: jax.Array, size: int) -> jax.Array:
    """±1 float32 signs from packed bits (any leading axes)."""
    b = jnp.unpackbits(bits, axis=-1)[..., :size]
    return jnp.where(b > 0, 1.0, -1.0).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Sign(Compressor):
    """One bit per element (``x ≥ 0`` is +1; the 1-bit code has no zero), all-gathered as packed bytes.

    * ``scaled=False``: signSGD with majority vote: the result is ``sign(Σᵢ signᵢ)`` (0 on a tie),
      not divided by the number of replicas.
    * ``scaled=True``: EF-signSGD's scaled sign ``mean|x| · sign(x)``, one extra float32 per
      vector; the result is the mean of every replica's scaled sign.
    """

    scaled: bool = False
    exchange = "all_gather"

    @property
    def name(self) -> str:
        return "scaled_sign" if self.scaled else "sign_vote"

    def encode(self, x, key):
        bits = _pack(x)
        return (bits, jnp.mean(jnp.abs(x))) if self.scaled else bits

    def decode(self, payload, size, key):
        if self.scaled:
            bits, scale = payload
            return scale * _unpack(bits, size)
        return _unpack(payload, size)

    def combine(self, received, size, world, key):
        if self.scaled:
            bits, scales = received
            return jnp.mean(scales[:, None] * _unpack(bits, size), axis=0)
        return jnp.sign(jnp.sum(_unpack(received, size), axis=0))


def sign(*, scaled: bool = False) -> Sign:
    """1-bit sign compression: majority vote (default) or EF-signSGD's scaled sign."""
    return Sign(scaled)
