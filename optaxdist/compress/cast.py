"""Low-precision casts: bf16 / fp16 on the wire (SINGA's half mode, with error feedback if wanted)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from optaxdist.comm.base import canonical_comm_dtype
from optaxdist.compress.base import Compressor

# (exponent bits, mantissa bits) of each 16-bit type, for lax.reduce_precision.
_PRECISION = {"bfloat16": (8, 7), "float16": (5, 10)}


def round_to(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Round float32 ``x`` to the values of ``dtype``, staying float32.

    ``x.astype(bf16).astype(f32)`` is not enough: XLA's "excess precision" simplification may
    delete the round trip, which silently zeroes an error-feedback residual. ``reduce_precision``
    survives compilation. fp16 overflow gives ±Inf, as the cast would.
    """
    exponent, mantissa = _PRECISION[jnp.dtype(dtype).name]
    return jax.lax.reduce_precision(x, exponent_bits=exponent, mantissa_bits=mantissa)


@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
    """Send every element in ``dtype`` (``bfloat16`` or ``float16``): 2 bytes per element."""

    dtype: str = "bfloat16"

    def __post_init__(self):
        dt = canonical_comm_dtype(self.dtype)
        if dt is None or dt.name == "float32":
            raise ValueError(f"dtype={self.dtype!r}; allowed: 'bfloat16', 'float16'")
        object.__setattr__(self, "dtype", dt.name)

    @property
    def name(self) -> str:
        return f"cast_{self.dtype}"

    def encode(self, x, key):
        return round_to(x, self.dtype).astype(self.dtype)

    def decode(self, payload, size, key):
        return payload.astype(jnp.float32)


def cast(dtype: str = "bfloat16") -> Cast:
    """A compressor that sends every element as ``dtype`` (bf16 or fp16), summed with one all-reduce."""
    return Cast(dtype)
