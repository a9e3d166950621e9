"""Compressors (pure) and compressed_allreduce with error feedback, on every harness."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist import compress
from tests.test_accounting import compiled_wire_bytes, ledger_wire_bytes

KEY = jax.random.key(0)

ALL = {
    "cast_bf16": compress.cast("bfloat16"),
    "cast_fp16": compress.cast("float16"),
    "top_k": compress.top_k(fraction=0.25),
    "random_k": compress.random_k(count=3),
    "block_k": compress.block_k(count=4),
    "threshold_dense": compress.threshold(0.5),
    "threshold_padded": compress.threshold(0.5, mode="padded", max_fraction=0.3),
    "sign_vote": compress.sign(),
    "scaled_sign": compress.sign(scaled=True),
    "int8": compress.quantize(8, block_size=4),
    "int4_stochastic": compress.quantize(4, block_size=6, rounding="stochastic"),
    "int2": compress.quantize(2, block_size=8),
    "e4m3": compress.quantize(8, block_size=4, format="e4m3"),
    "chunked_top_k": compress.chunked_top_k(8, 2),
    "int4_chunked_top_k": compress.chunked_top_k(16, 4, values=compress.quantize(4, block_size=2)),
    "e4m3_chunked_top_k": compress.chunked_top_k(
        16, 4, values=compress.quantize(8, block_size=4, format="e4m3")
    ),
    "int2_sigma": compress.quantize(2, block_size=8, scale="sigma"),
    "int4_sigma_stochastic": compress.quantize(4, block_size=6, scale="sigma", rounding="stochastic"),
    "int2_sigma_chunked_top_k": compress.chunked_top_k(
        16, 4, values=compress.quantize(2, block_size=4, scale="sigma")
    ),
}


def grads(n, shape=(3, 4), seed=0):
    rng = np.random.default_rng(seed)
    return {
        "kernel": rng.normal(size=(n, *shape)).astype(np.float32) * 0.3,
        "bias": rng.normal(size=(n, shape[-1])).astype(np.float32) * 0.3,
    }


def one_step(harness, compressor, g, **kw):
    tx = od.compressed_allreduce(compressor, comm=harness.comm, **kw)
    return harness.run(lambda x: tx.update(x, tx.init(x)), g)


# ---- pure compressors --------------------------------------------------------------------------


def test_top_k_is_true_magnitude_top_k_below_one():
    x = jnp.asarray([0.1, -0.9, 0.3, 0.05, -0.4, 0.2], jnp.float32)  # all |x| < 1 (SINGA bug S1)
    idx, vals = compress.top_k(count=3).encode(x, KEY)
    assert sorted(np.asarray(idx).tolist()) == [1, 2, 4]
    np.testing.assert_array_equal(np.sort(np.asarray(vals)), np.float32([-0.9, -0.4, 0.3]))


def test_random_k_same_indices_for_the_same_key():
    c = compress.random_k(fraction=0.3)
    x = jnp.arange(1.0, 21.0)
    a = c.decode(c.encode(x, KEY), 20, KEY)
    b = c.decode(c.encode(x + 100, KEY), 20, KEY)
    assert (np.asarray(a) != 0).sum() == 6
    np.testing.assert_array_equal(np.asarray(a) != 0, np.asarray(b) != 0)


def test_block_k_wraps_and_reaches_every_coordinate():
    c = compress.block_k(count=3)
    size = 10  # 10 mod 3 != 0: mlbench's blockwise never selects the tail
    covered = np.zeros(size, bool)
    for i in range(60):
        key = jax.random.key(i)
        sent = np.asarray(c.decode(c.encode(jnp.ones(size), key), size, key))
        assert sent.sum() == 3
        covered |= sent != 0
    assert covered.all()


def test_sign_round_trip_and_no_zero_in_the_code():
    x = jnp.asarray([0.5, -2.0, 0.0, 3.0, -0.1, 1.0, -1.0, 2.0, -3.0], jnp.float32)
    bits = compress.sign().encode(x, KEY)
    assert bits.dtype == jnp.uint8 and bits.shape == (2,)
    np.testing.assert_array_equal(compress.sign().decode(bits, 9, KEY), np.where(x >= 0, 1, -1))
    scaled = compress.sign(scaled=True)
    np.testing.assert_allclose(
        scaled.decode(scaled.encode(x, KEY), 9, KEY), np.mean(np.abs(x)) * np.where(x >= 0, 1, -1)
    )


@pytest.mark.parametrize("name", sorted(ALL))
def test_sent_plus_residual_equals_input_exactly(name):
    c = ALL[name]
    x = jnp.asarray(np.random.default_rng(1).normal(size=37).astype(np.float32))
    round_trip = jax.jit(lambda v: c.decode(c.encode(v, KEY), 37, KEY))  # one program, not one per op
    sent = round_trip(x)
    residual = x - sent
    assert np.isfinite(np.asarray(round_trip(jnp.zeros_like(x)))).all()  # zeros: no 0/0 in a scale
    if "sign" in name or name.startswith("int"):
        # x − s·sign(x) and x − n·s (quantized) are rounded; their sum with the sent part is within an ulp
        np.testing.assert_allclose(np.asarray(sent + residual), np.asarray(x), rtol=0, atol=1e-7)
    else:
        np.testing.assert_array_equal(np.asarray(sent + residual), np.asarray(x))
    if name.startswith(("top", "random", "block", "threshold", "chunked")):
        # the sparsifiers send entries unchanged: sent and residual have disjoint supports
        assert not np.any((np.asarray(sent) != 0) & (np.asarray(residual) != 0))


def test_bf16_rounding_survives_compilation():
    """XLA may delete f32→bf16→f32; the residual of a bf16 cast must still be non-zero."""
    tx = od.compressed_allreduce(compress.cast("bfloat16"), comm=od.AxisComm("replica"))
    g = jnp.full((2, 8), 1.0 + 2.0**-10, jnp.float32)  # not representable in bf16
    state = jax.jit(jax.vmap(lambda x: tx.update(x, tx.init(x))[1], axis_name="replica"))(g)
    np.testing.assert_allclose(np.asarray(state.error), 2.0**-10)
    compiled = (
        jax.jit(jax.vmap(lambda x: tx.update(x, tx.init(x))[1].error, axis_name="replica"))
        .lower(g)
        .compile()
        .as_text()
    )
    assert "reduce-precision" in compiled


# ---- compressed_allreduce on the harnesses -------------------------------------------------------


def allreduce_mean(g):
    return jax.tree.map(lambda x: np.broadcast_to(x.mean(0), x.shape), g)


@pytest.mark.parametrize(
    "c",
    [
        compress.top_k(fraction=1.0),
        compress.threshold(0.0),
        compress.threshold(0.0, mode="padded", max_fraction=1.0),
    ],
    ids=["top_k_all", "threshold_0_dense", "threshold_0_padded"],
)
@pytest.mark.parametrize("scope", ["leaf", "model"])
def test_lossless_settings_equal_allreduce(harness, c, scope):
    g = grads(harness.n)
    out, state = one_step(harness, c, g, scope=scope)
    for k in g:
        np.testing.assert_allclose(out[k], allreduce_mean(g)[k], atol=1e-6)
        np.testing.assert_array_equal(state.error[k], 0.0)


def test_cast_equals_low_precision_allreduce(harness):
    g = grads(harness.n)
    out, _ = one_step(harness, compress.cast("bfloat16"), g)
    rounded = {k: v.astype(jnp.bfloat16).astype(np.float32) for k, v in g.items()}
    for k in g:
        np.testing.assert_allclose(out[k], allreduce_mean(rounded)[k], rtol=1e-2, atol=1e-3)


def test_top_k_sum_of_selected_divided_by_world(harness):
    n = harness.n
    g = grads(n)
    out, state = one_step(harness, compress.top_k(count=2), g, error_feedback=True)
    want = np.zeros_like(g["bias"])
    for i in range(n):
        sel = np.argsort(-np.abs(g["bias"][i]))[:2]
        want[:, sel] += g["bias"][i, sel] / n
    np.testing.assert_allclose(out["bias"], want, atol=1e-6)
    np.testing.assert_allclose(state.error["bias"] + np.where(want != 0, 0, 0), state.error["bias"])
    stats = od.comm_stats(state)
    assert stats.by_kind == {"all_gather[top_k]": od.KindTotals(1, 2 * (2 * 4 + 2 * 4))}


def test_majority_vote_against_numpy(harness):
    g = grads(harness.n)
    out, state = one_step(harness, compress.sign(), g, error_feedback=False)
    for k in g:
        votes = np.where(g[k] >= 0, 1, -1).sum(0)
        np.testing.assert_array_equal(out[k], np.broadcast_to(np.sign(votes), g[k].shape))
    assert state.error == () or jax.tree.leaves(state.error) == []
    assert od.comm_stats(state).bytes == 2 + 1  # 12 bits -> 2 bytes, 4 bits -> 1 byte


# one compressor of each family on the mesh by default (all of them in the full run)
MESH_SAMPLE = ("cast_bf16", "top_k", "threshold_padded", "sign_vote", "int4_stochastic", "int2_sigma")
MESH_SAMPLE += ("e4m3_chunked_top_k",)
EVERY_HARNESS = ("vmap", "mesh", "mpi")


# each compressor's round trip of zeros is checked in test_sent_plus_residual_equals_input_exactly;
# this is the transform's error feedback around it, the same for every compressor
@pytest.mark.sample(*MESH_SAMPLE, harnesses=EVERY_HARNESS)
@pytest.mark.parametrize("name", sorted(ALL))
def test_zero_gradients_give_no_nan(harness, name):
    g = jax.tree.map(np.zeros_like, grads(harness.n))
    out, state = one_step(harness, ALL[name], g)
    for leaf in jax.tree.leaves((out, state.error)):
        assert np.isfinite(leaf).all()


# the error feedback and the step's keys do not depend on the compressor (each one's own identity:
# test_sent_plus_residual_equals_input_exactly); by default a sample of the families, random_k's
# shared keys too, on vmap
@pytest.mark.sample(*MESH_SAMPLE, "random_k", harnesses=("vmap",))
@pytest.mark.sample(*MESH_SAMPLE)
@pytest.mark.parametrize("name", sorted(ALL))
def test_any_leaf_shape_and_error_feedback_accumulates(harness, name):
    n = harness.n
    g = grads(n, shape=(2, 3, 5))
    tx = od.compressed_allreduce(ALL[name], comm=harness.comm)

    def two_steps(x):
        s = tx.init(x)
        _, s1 = tx.update(x, s)
        u2, s2 = tx.update(x, s1)
        return u2, s1.error, s2.error

    u2, e1, e2 = harness.run(two_steps, g)
    assert u2["kernel"].shape == (n, 2, 3, 5)
    # second step compressed g + e1 and kept (g + e1) - sent
    c = ALL[name]
    step_key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), 1), 1)  # step 1, leaf 1
    v = (g["kernel"][0] + e1["kernel"][0]).reshape(-1)
    sent = np.asarray(jax.jit(lambda x: c.decode(c.encode(x, step_key), v.size, step_key))(v))
    np.testing.assert_allclose(e2["kernel"][0].reshape(-1), v - sent, atol=1e-6)


@pytest.mark.against_vmap
def test_same_numbers_on_every_harness(harness):
    from tests.harness import VmapHarness

    g = grads(harness.n)
    for c in (compress.top_k(fraction=0.3), compress.random_k(count=3), compress.sign(scaled=True)):
        out, state = one_step(harness, c, g)
        ref, ref_state = one_step(VmapHarness(harness.n), c, g)
        for k in g:
            np.testing.assert_allclose(out[k], ref[k], atol=1e-6)
            np.testing.assert_allclose(state.error[k], ref_state.error[k], atol=1e-6)


def test_world_size_one_still_compresses():
    from tests.harness import VmapHarness

    g = grads(1)
    out, state = one_step(VmapHarness(1), compress.top_k(count=1), g)
    assert (out["bias"] != 0).sum() == 1
    np.testing.assert_allclose(out["bias"] + state.error["bias"], g["bias"], atol=1e-7)


def test_exact_warmup_then_compress(harness):
    n = harness.n
    g = grads(n)
    tx = od.exact_warmup(
        od.compressed_allreduce(compress.top_k(count=1), comm=harness.comm),
        comm=harness.comm,
        warmup_steps=2,
    )

    def three(x):
        s = tx.init(x)
        u1, s = tx.update(x, s)
        u2, s = tx.update(x, s)
        e2 = s.compressed_state.error
        u3, s = tx.update(x, s)
        return u1, u2, e2, u3, s

    u1, u2, e2, u3, s = harness.run(three, g)
    for k in g:
        np.testing.assert_allclose(u1[k], allreduce_mean(g)[k], atol=1e-6)
        np.testing.assert_allclose(u2[k], allreduce_mean(g)[k], atol=1e-6)
        np.testing.assert_array_equal(e2[k], 0.0)
        assert (u3[k][0] != 0).sum() <= n
    stats = od.comm_stats(s)
    assert stats.by_kind["all_reduce[float32]"].collectives == 2
    assert stats.by_kind["all_gather[top_k]"].collectives == 1


@pytest.mark.parametrize("name", sorted(ALL))
def test_ledger_equals_compiled_collectives(name):
    n = 4
    mesh = jax.make_mesh(
        (n,), ("replica",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    c = ALL[name]
    tx = od.compressed_allreduce(c, comm=od.AxisComm("replica"))
    g = grads(n, shape=(8, 16))
    fn = od.on_mesh(lambda x: tx.update(x, tx.init(x)), mesh)
    stats = od.comm_stats(fn(g)[1])
    assert stats.collectives == 1
    sent = compiled_wire_bytes(fn, g)
    assert sum(sent.values()) == pytest.approx(ledger_wire_bytes(stats, n))
    if name == "cast_bf16":
        assert set(sent) == {"u16"}  # the bits of the bfloat16 values, not float32
    if name == "top_k":
        d = 8 * 16
        k = int(np.floor(0.25 * d)) + int(np.floor(0.25 * 16))
        assert sent == {"s32": (n - 1) * k * 4, "f32": (n - 1) * k * 4}


def test_bad_arguments():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="exactly one of fraction"):
        compress.top_k()
    with pytest.raises(ValueError, match="fraction="):
        compress.random_k(fraction=1.5)
    with pytest.raises(ValueError, match="count="):
        compress.block_k(count=0)
    with pytest.raises(ValueError, match="tau="):
        compress.threshold(-1.0)
    with pytest.raises(ValueError, match="mode="):
        compress.threshold(0.1, mode="sparse")
    with pytest.raises(ValueError, match="max_fraction"):
        compress.threshold(0.1, max_count=3)
    with pytest.raises(ValueError, match="dtype="):
        compress.cast("float32")
    with pytest.raises(TypeError, match="compressor"):
        od.compressed_allreduce("top_k", comm=comm)
    with pytest.raises(ValueError, match="scope="):
        od.compressed_allreduce(compress.sign(), comm=comm, scope="layer")
    with pytest.raises(ValueError, match="residual_dtype"):
        od.compressed_allreduce(compress.sign(), comm=comm, residual_dtype=jnp.int32)
    with pytest.raises(ValueError, match="steps="):
        od.exact_warmup(optax.identity(), comm=comm, warmup_steps=-1)


def test_random_k_picks_uniform_distinct_subsets():
    c = compress.random_k(count=5)
    keys = jax.random.split(jax.random.key(3), 2000)
    idx = np.asarray(jax.vmap(lambda k: c._indices(20, k))(keys))
    assert all(len(set(row)) == 5 for row in idx)  # distinct
    counts = np.bincount(idx.ravel(), minlength=20)
    np.testing.assert_allclose(counts / 2000, 5 / 20, atol=0.04)  # each coordinate w.p. k/d


# ---- block-wise quantization -------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_quantize_error_within_the_block_scale(bits, rounding):
    c = compress.quantize(bits, block_size=64, rounding=rounding)
    x = jax.random.normal(jax.random.key(1), (1000,)) * jnp.repeat(jnp.logspace(-3, 2, 16), 64)[:1000]
    packed, scale = c.encode(x, KEY)
    assert packed.dtype == jnp.uint8 and packed.shape == (16 * 64 * bits // 8,)
    assert scale.dtype == jnp.float32 and scale.shape == (16,)
    err = np.abs(np.pad(np.asarray(c.decode((packed, scale), 1000, KEY) - x), (0, 24))).reshape(16, 64)
    bound = np.asarray(scale)[:, None] * (0.5 if rounding == "nearest" else 1.0)
    assert (err <= bound * (1 + 1e-6)).all()
    # the scale is the block's largest magnitude over q (XLA may divide by a constant as a product)
    want = np.abs(np.pad(x, (0, 24))).reshape(16, 64).max(1) / c.levels
    np.testing.assert_allclose(np.asarray(scale), want, rtol=2e-7)


@pytest.mark.parametrize("bits", [4, 2])
def test_packed_codes_unpack_to_the_same_values(bits):
    from optaxdist.compress.quantize import _pack, _unpack

    codes = jax.random.randint(KEY, (96,), 0, 2**bits).astype(jnp.uint8)
    packed = _pack(codes, bits)
    assert packed.shape == (96 * bits // 8,)
    np.testing.assert_array_equal(_unpack(packed, bits, 96), codes)
    np.testing.assert_array_equal(_unpack(jnp.stack([packed, packed]), bits, 96), jnp.stack([codes, codes]))


def test_stochastic_rounding_is_unbiased():
    c = compress.quantize(2, block_size=8, rounding="stochastic")
    x = jnp.asarray([1.0, 0.3, -0.55, 0.0, 0.9, -1.0, 0.2, 0.05])  # scale 1: values in {-1, 0, 1}
    keys = jax.random.split(KEY, 4000)
    mean = jax.vmap(lambda k: c.decode(c.encode(x, k), 8, k))(keys).mean(0)
    np.testing.assert_allclose(mean, x, atol=0.03)


@pytest.mark.parametrize("fmt, ulp", [("e4m3", 2.0**-3), ("e5m2", 2.0**-2)])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float8_error_within_its_ulp(fmt, ulp, rounding):
    from optaxdist.compress.quantize import FLOAT8

    c = compress.quantize(8, block_size=64, format=fmt, rounding=rounding)
    x = jax.random.normal(jax.random.key(1), (1000,)) * jnp.repeat(jnp.logspace(-3, 2, 16), 64)[:1000]
    packed, scale = c.encode(x, KEY)
    assert packed.dtype == jnp.uint8 and packed.shape == (1024,) and scale.shape == (16,)
    np.testing.assert_allclose(
        np.asarray(scale), np.abs(np.pad(x, (0, 24))).reshape(16, 64).max(1) / c.levels, rtol=2e-7
    )
    got = np.asarray(c.decode((packed, scale), 1000, KEY))
    x = np.asarray(x)
    # relative to the value where its scaled magnitude is a normal 8-bit float: half an ulp (nearest)
    # or one ulp (stochastic) of the format's significand
    tiny = float(jnp.finfo(FLOAT8[fmt]).tiny)  # the smallest normal 8-bit float
    normal = np.abs(x) >= np.repeat(np.asarray(scale), 64)[:1000] * tiny
    bound = ulp * (0.5 if rounding == "nearest" else 1.0)
    assert normal.mean() > 0.9
    assert (np.abs(got - x)[normal] <= bound * np.abs(x[normal]) * (1 + 1e-6)).all()
    # and the largest magnitude of each block is exact: it maps to the format's largest value
    blocks = np.pad(x, (0, 24)).reshape(16, 64)
    top = np.abs(blocks).argmax(1)
    np.testing.assert_allclose(
        np.pad(got, (0, 24)).reshape(16, 64)[np.arange(16), top], blocks[np.arange(16), top], rtol=2e-7
    )


def test_float8_stochastic_rounding_is_unbiased():
    c = compress.quantize(8, block_size=8, format="e4m3", rounding="stochastic")
    x = jnp.asarray([1.0, 0.3, -0.55, 0.0, 0.9, -1.0, 0.2, 0.05])
    keys = jax.random.split(KEY, 4000)
    samples = jax.vmap(lambda k: c.decode(c.encode(x, k), 8, k))(keys)
    assert len(np.unique(np.asarray(samples[:, 1]))) == 2  # 0.3 lies between two 8-bit floats
    np.testing.assert_allclose(samples.mean(0), x, atol=2e-3)


def np_quantized_mean(c, g):
    """NumPy model: every replica's block-wise quantization (round half to even), decoded, averaged."""
    out = []
    for x in g:
        flat = x.reshape(-1).astype(np.float64)
        num = -(-flat.size // c.block_size)
        blocks = np.pad(flat, (0, num * c.block_size - flat.size)).reshape(num, -1).astype(np.float32)
        scale = np.abs(blocks).max(1) / np.float32(c.levels)
        scaled = blocks / np.where(scale > 0, scale, 1)[:, None]
        if c.format == "int":
            ints = np.clip(np.round(scaled), -c.levels, c.levels)
        else:
            ints = np_float8(np.clip(scaled, -c.levels, c.levels), c.format)
        out.append((ints * scale[:, None]).reshape(-1)[: flat.size].reshape(x.shape))
    return np.mean(out, axis=0)


def np_float8(x, fmt):
    """``x`` rounded to the nearest 8-bit float of ``fmt`` (half to even: ml_dtypes' cast), as float32."""
    import ml_dtypes

    return x.astype({"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]).astype(np.float32)


@pytest.mark.parametrize(
    "bits, fmt", [(8, "int"), (4, "int"), (8, "e4m3"), pytest.param(8, "e5m2", marks=pytest.mark.slow)]
)
def test_quantized_allreduce_against_numpy(harness, bits, fmt):
    c = compress.quantize(bits, block_size=4, format=fmt)
    g = grads(harness.n)
    out, state = one_step(harness, c, g, error_feedback=False)
    for k in g:
        np.testing.assert_allclose(out[k], np.broadcast_to(np_quantized_mean(c, g[k]), g[k].shape), atol=1e-6)
    # kernel 3×4 = 12 values: 3 blocks; bias 4 values: 1 block; bits/8 bytes per value, 4 per scale
    per_replica = (12 * bits // 8 + 3 * 4) + (4 * bits // 8 + 1 * 4)
    name = f"int{bits}" if fmt == "int" else fmt
    assert od.comm_stats(state).by_kind == {f"all_gather[{name}/4]": od.KindTotals(1, per_replica)}


def test_quantize_bad_arguments():
    with pytest.raises(ValueError, match="bits=3"):
        compress.quantize(3)
    with pytest.raises(ValueError, match="block_size=5"):
        compress.quantize(2, block_size=5)
    with pytest.raises(ValueError, match="rounding='up'"):
        compress.quantize(8, rounding="up")
    with pytest.raises(ValueError, match="bits=8.0"):
        compress.quantize(8.0)
    with pytest.raises(ValueError, match="block_size=True"):
        compress.quantize(8, block_size=True)
    with pytest.raises(ValueError, match="format='fp8'; allowed"):
        compress.quantize(8, format="fp8")
    with pytest.raises(ValueError, match="format='e4m3' is an 8-bit float .* needs bits=8"):
        compress.quantize(4, format="e4m3")
    with pytest.raises(ValueError, match="format='e5m2' .* scale='absmax'"):
        compress.quantize(8, format="e5m2", scale="sigma")


# ---- σ bins (scale="sigma", SparseLoCo) ----------------------------------------------------------


def np_sigma_bins(c, x):
    """NumPy model of ``scale="sigma"``: per block (padding left out) the mean, the sample σ, the
    step sigmas·σ/L, the codes, and each value's decoded table entry (float64)."""
    L, half = c.bins, c.bins // 2
    out = []
    for start in range(0, x.size, c.block_size):
        b = x[start : start + c.block_size].astype(np.float64)
        mean = b.mean()
        sd = np.sqrt(((b - mean) ** 2).sum() / max(b.size - 1, 1))
        step = c.sigmas * sd / L if sd > 0 else 1.0
        codes = np.clip(np.round((b - mean) / step), -half, half - 1).astype(int) + half
        if c.rounding == "nearest":
            table = np.array([b[codes == j].mean() if (codes == j).any() else 0.0 for j in range(L)])
        else:
            table = mean + (np.arange(L) - half) * step
        out.append((codes, table, step))
    return out


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_sigma_bins_decode_to_the_bin_centroids(bits):
    c = compress.quantize(bits, block_size=64, scale="sigma")
    assert c.name == f"int{bits}/64,sigma6" and c.bins == 2**bits
    # 1000 values: 15 whole blocks and one of 40 (its padding left out of the statistics)
    x = jax.random.normal(jax.random.key(1), (1000,)) * jnp.repeat(jnp.logspace(-3, 2, 16), 64)[:1000] + 0.1
    packed, table = c.encode(x, KEY)
    assert packed.dtype == jnp.uint8 and packed.shape == (16 * 64 * bits // 8,)
    assert table.dtype == jnp.float32 and table.shape == (16 * 2**bits,)
    y = np.asarray(c.decode((packed, table), 1000, KEY), np.float64)
    xs = np.asarray(x, np.float64)
    for b, (codes, want_table, step) in enumerate(np_sigma_bins(c, np.asarray(x))):
        sl = slice(64 * b, 64 * b + codes.size)
        np.testing.assert_allclose(y[sl], want_table[codes], rtol=1e-5, atol=1e-6 * step)
        for j in np.unique(codes):  # each value moved to the mean of its bin: the bin's sum is kept
            members = codes == j
            spread = np.ptp(xs[sl][members])
            assert np.abs(y[sl][members] - xs[sl][members]).max() <= spread * (1 + 1e-5) + 1e-6 * step
            if 0 < j < 2**bits - 1:  # an inner bin is one step wide
                assert spread <= step * (1 + 1e-5)
        np.testing.assert_allclose(y[sl].sum(), xs[sl].sum(), rtol=1e-5, atol=1e-5 * step * codes.size)


def test_sigma_bins_at_two_bits_are_four_levels_over_six_sigma():
    """2 bits: bins 1.5σ wide centred on μ − 3σ, μ − 1.5σ, μ, μ + 1.5σ; every code is a level (no
    zero level is reserved), so top-k values of either sign all keep a magnitude."""
    c = compress.quantize(2, block_size=8, scale="sigma")
    x = jnp.asarray([-3.0, -2.0, -1.5, -0.2, 0.3, 1.0, 2.5, 4.0])
    mean, sd = float(np.mean(x)), float(np.std(np.asarray(x), ddof=1))
    codes, _, step = np_sigma_bins(c, np.asarray(x))[0]
    assert step == pytest.approx(1.5 * sd)
    y = np.asarray(c.decode(c.encode(x, KEY), 8, KEY))
    centred = (np.asarray(x) - mean) / step
    assert (codes == np.clip(np.round(centred), -2, 1) + 2).all()
    assert set(np.unique(y).round(4)) == {np.mean(np.asarray(x)[codes == j]).round(4) for j in set(codes)}


def test_sigma_bins_stochastic_is_unbiased_within_the_range():
    c = compress.quantize(2, block_size=8, scale="sigma", rounding="stochastic")
    x = jnp.asarray([1.0, 0.3, -0.55, 0.0, 0.9, -1.0, 0.2, 0.05])  # all within [μ − 2s, μ + s]
    keys = jax.random.split(KEY, 4000)
    samples = jax.vmap(lambda k: c.decode(c.encode(x, k), 8, k))(keys)
    _, table, step = np_sigma_bins(c, np.asarray(x))[0]
    assert (np.abs(np.asarray(samples[0])[:, None] - table[None, :]).min(1) < 1e-6).all()  # bin centres
    assert (np.abs(np.asarray(samples) - np.asarray(x)) < step * (1 + 1e-6)).all()
    np.testing.assert_allclose(samples.mean(0), x, atol=0.03)


def test_sigma_bins_constant_block_and_single_value_are_exact():
    c = compress.quantize(8, block_size=4, scale="sigma")
    x = jnp.asarray([0.5, 0.5, 0.5, 0.5, -2.0])  # σ = 0 in both blocks (the second has one value)
    np.testing.assert_array_equal(np.asarray(c.decode(c.encode(x, KEY), 5, KEY)), np.asarray(x))


def test_sigma_bins_non_finite_value_makes_its_block_nan():
    c = compress.quantize(2, block_size=4, scale="sigma")
    x = jnp.asarray([1.0, jnp.inf, -2.0, 0.5, 1.0, -1.0, 0.25, 0.0])
    y = np.asarray(c.decode(c.encode(x, KEY), 8, KEY))
    assert np.isnan(y[:4]).all() and np.isfinite(y[4:]).all()


def test_sigma_bins_bad_arguments():
    with pytest.raises(ValueError, match="scale='max'"):
        compress.quantize(2, scale="max")
    for bad in (0, -1.0, float("inf"), True, "6"):
        with pytest.raises(ValueError, match="sigmas="):
            compress.quantize(2, scale="sigma", sigmas=bad)
    with pytest.raises(ValueError, match="sigmas=4 applies to scale='sigma' only"):
        compress.quantize(2, sigmas=4)
    with pytest.raises(ValueError, match="exchange='all_gather' only"):
        compress.quantize(2, scale="sigma", exchange="two_phase")


def test_quantize_non_finite_value_makes_its_block_nan():
    c = compress.quantize(4, block_size=4)
    x = jnp.asarray([1.0, jnp.inf, -2.0, 0.5, 1.0, -1.0, 0.25, 0.0])
    y = np.asarray(c.decode(c.encode(x, KEY), 8, KEY))
    assert np.isnan(y[:4]).all()  # deterministic, not an implementation-defined cast of NaN
    np.testing.assert_allclose(y[4:], np.float32([1.0, -1.0, 2 / 7, 0.0]), atol=1e-6)


def test_numpy_sizes_configure_a_compressor_as_python_ints():
    """A sweep's NumPy sizes give the compressor of the Python ints: equal, with the same hash
    (the compiled step's cache)."""
    assert compress.quantize(np.int64(4), block_size=np.int64(64)) == compress.quantize(4, block_size=64)
    chunked = compress.chunked_top_k(np.int64(64), np.int32(8))
    assert chunked == compress.chunked_top_k(64, 8) and hash(chunked) == hash(compress.chunked_top_k(64, 8))
    assert type(chunked.k) is int and type(chunked.chunk_size) is int
    with pytest.raises(ValueError, match="k=np.True_|k=True"):
        compress.chunked_top_k(64, np.True_)
    for make in (compress.top_k, compress.random_k, compress.block_k):
        sparse = make(count=np.int64(3))
        assert sparse == make(count=3) and hash(sparse) == hash(make(count=3)) and type(sparse.count) is int
        assert make(fraction=np.float32(0.7)) == make(fraction=0.7)  # as written, not 0.699999988
        assert make(fraction=np.asarray(0.7, np.float32)).fraction == 0.7
        with pytest.raises(ValueError, match="fraction=True must be a real number in"):
            make(fraction=True)
        with pytest.raises(ValueError, match=r"count=(np.int64\()?0\)? must be an int ≥ 1"):
            make(count=np.int64(0))
    padded = compress.threshold(0.1, mode="padded", max_count=np.int64(5))
    assert padded == compress.threshold(0.1, mode="padded", max_count=5) and type(padded.max_count) is int
    with pytest.raises(ValueError, match="give exactly one of max_fraction= .* or max_count="):
        compress.threshold(0.1, mode="padded")
