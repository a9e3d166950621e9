"""Chunked top-k with bit-packed in-chunk indices and float32 or quantized values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optaxdist as od
from optaxdist import compress
from optaxdist.accounting import payload_bytes
from optaxdist.compress.chunked import pack_bits, unpack_bits

KEY = jax.random.key(0)


def numpy_chunked_top_k(x: np.ndarray, chunk: int, k: int) -> np.ndarray:
    """The sparse array of each chunk's ``k`` largest magnitudes of ``x`` flattened (the last chunk
    zero-padded), in ``x``'s shape and dtype."""
    flat = x.reshape(-1)
    num = math.ceil(flat.size / chunk)
    padded = np.zeros(num * chunk, flat.dtype)
    padded[: flat.size] = flat
    out = np.zeros_like(padded)
    for c in range(num):
        part = padded[c * chunk : (c + 1) * chunk]
        keep = np.argsort(-np.abs(part), kind="stable")[:k]
        out[c * chunk + keep] = part[keep]
    return out[: flat.size].reshape(x.shape)


@pytest.mark.parametrize("bits", [1, 3, 7, 12, 16])
def test_packed_indices_unpack_to_the_same_codes(bits):
    count = 37
    codes = jax.random.randint(KEY, (count,), 0, 2**bits).astype(jnp.uint32)
    packed = pack_bits(codes, bits)
    assert packed.dtype == jnp.uint8 and packed.shape == (math.ceil(count * bits / 8),)
    np.testing.assert_array_equal(unpack_bits(packed, bits, count), codes)


@pytest.mark.parametrize("size,chunk,k", [(100, 16, 3), (4096, 4096, 64), (37, 64, 5), (64, 8, 8)])
def test_each_chunk_keeps_its_k_largest_entries(size, chunk, k):
    c = compress.chunked_top_k(chunk, k)
    x = jnp.asarray(np.random.default_rng(size).normal(size=size).astype(np.float32))
    sent = c.decode(c.encode(x, KEY), size, KEY)
    np.testing.assert_array_equal(np.asarray(sent), numpy_chunked_top_k(np.asarray(x), chunk, k))


def test_quantized_values_are_the_quantizer_of_the_kept_values():
    values = compress.quantize(4, block_size=4)
    c = compress.chunked_top_k(16, 4, values=values)
    x = jnp.asarray(np.random.default_rng(2).normal(size=50).astype(np.float32))
    sent = np.asarray(c.decode(c.encode(x, KEY), 50, KEY))
    exact = numpy_chunked_top_k(np.asarray(x), 16, 4)
    assert np.array_equal(sent != 0, exact != 0)  # the same positions
    kept = exact[exact != 0]
    np.testing.assert_array_equal(
        sent[sent != 0], np.asarray(values.decode(values.encode(kept, KEY), kept.size, KEY))
    )


def test_payload_bytes_count_the_index_bits():
    sparseloco = compress.chunked_top_k(4096, 64, values=compress.quantize(2, block_size=64))
    assert sparseloco.index_bits == 12 and sparseloco.name == "chunked_top_k/64of4096,int2/64"
    payload = sparseloco.encode(jnp.ones(4096), KEY)
    # 64 indices × 12 bits, 64 values × 2 bits, one float32 scale: 141× less than float32
    assert payload_bytes(payload) == 96 + 16 + 4
    plain = compress.chunked_top_k(1000, 10)
    assert plain.index_bits == 10
    # 3 chunks of 1000 for 2500 values: 30 indices of 10 bits, 30 float32 values
    assert payload_bytes(plain.encode(jnp.ones(2500), KEY)) == math.ceil(30 * 10 / 8) + 30 * 4


def test_all_replicas_sum_of_what_each_sent_over_world(harness):
    n = harness.n
    rng = np.random.default_rng(3)
    g = {"w": rng.normal(size=(n, 5, 8)).astype(np.float32)}
    c = compress.chunked_top_k(16, 3)
    tx = od.compressed_allreduce(c, comm=harness.comm)
    out, state = harness.run(lambda x: tx.update(x, tx.init(x)), g)
    want = sum(numpy_chunked_top_k(g["w"][i].reshape(-1), 16, 3) for i in range(n)) / n
    np.testing.assert_allclose(out["w"][0].reshape(-1), want, atol=1e-7)
    for i in range(n):
        np.testing.assert_array_equal(
            state.error["w"][i].reshape(-1),
            g["w"][i].reshape(-1) - numpy_chunked_top_k(g["w"][i].reshape(-1), 16, 3),
        )
    # 40 values: 3 chunks × 3 indices of 4 bits (5 bytes), 9 float32 values
    assert od.comm_stats(state).by_kind == {"all_gather[chunked_top_k/3of16]": od.KindTotals(1, 5 + 36)}


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        compress.chunked_top_k(1, 1)
    with pytest.raises(ValueError, match="k=65"):
        compress.chunked_top_k(64, 65)
    with pytest.raises(ValueError, match="k=0"):
        compress.chunked_top_k(64, 0)
    with pytest.raises(ValueError, match="block_size=8 must divide k=12"):
        compress.chunked_top_k(64, 12, values=compress.quantize(8, block_size=8))
    with pytest.raises(TypeError, match="values must be"):
        compress.chunked_top_k(64, 8, values=compress.cast("bfloat16"))
    with pytest.raises(ValueError, match="exchange='two_phase'"):
        compress.chunked_top_k(64, 8, values=compress.quantize(8, block_size=8, exchange="two_phase"))
