"""Pure compressors: encode/decode of flat vectors, no communication inside."""

from optaxdist.compress.base import Compressor
from optaxdist.compress.cast import Cast, cast, round_to
from optaxdist.compress.chunked import ChunkedTopK, chunked_top_k
from optaxdist.compress.quantize import Quantize, quantize
from optaxdist.compress.sign import Sign, sign
from optaxdist.compress.sparse import (
    BlockK,
    RandomK,
    Threshold,
    TopK,
    block_k,
    random_k,
    threshold,
    top_k,
)

__all__ = [
    "BlockK",
    "Cast",
    "ChunkedTopK",
    "Compressor",
    "Quantize",
    "RandomK",
    "Sign",
    "Threshold",
    "TopK",
    "block_k",
    "cast",
    "chunked_top_k",
    "quantize",
    "random_k",
    "round_to",
    "sign",
    "threshold",
    "top_k",
]
