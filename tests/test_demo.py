"""DeMo: per-replica momentum, top-k of each block's DCT sent, the sent part subtracted, the sign of
the replicas' mean applied."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.transforms.demo import _coefficients, _leaf_plan, _values, block_side, dct_matrix
from tests.harness import VmapHarness
from tests.test_accounting import compiled_wire_bytes, ledger_wire_bytes

STEPS, LR, CHUNK, K, BETA = 4, 0.05, 4, 3, 0.9
# a matrix of 2 × 2 blocks (4 × 3 values), a vector in blocks of 1 × 2, a 3-axis leaf viewed as a
# 6 × 4 matrix (blocks of 3 × 4), a vector of prime length (blocks of one value) and a scalar
SHAPES = {"w": (8, 6), "b": (10,), "c": (2, 3, 4), "p": (7,), "s": ()}


def start_params():
    rng = np.random.default_rng(0)
    return {key: rng.normal(size=shape).astype(np.float32) for key, shape in SHAPES.items()}


def gradient_data(n, steps=STEPS, seed=1):
    rng = np.random.default_rng(seed)
    return {key: rng.normal(size=(n, steps, *shape)).astype(np.float32) for key, shape in SHAPES.items()}


# ---- a NumPy transcription (float64) ------------------------------------------------------------


def np_dct(n):
    """The orthonormal DCT-II matrix, written from its definition element by element."""
    out = np.empty((n, n))
    for k in range(n):
        scale = math.sqrt((1 if k == 0 else 2) / n)
        for j in range(n):
            out[k, j] = scale * math.cos(math.pi * (2 * j + 1) * k / (2 * n))
    return out


def np_side(n, chunk):
    return n if n <= chunk else max(d for d in range(1, chunk + 1) if n % d == 0)


def np_extract(m, chunk, k):
    """q: the inverse DCT of the top-k DCT coefficients of every block of ``m``."""
    shape = m.shape
    mat = m.reshape(1, -1) if m.ndim < 2 else m.reshape(-1, shape[-1])
    rows, cols = mat.shape
    h, w = np_side(rows, chunk), np_side(cols, chunk)
    dh, dw = np_dct(h), np_dct(w)
    q = np.zeros_like(mat)
    for r in range(0, rows, h):
        for c in range(0, cols, w):
            coef = (dh @ mat[r : r + h, c : c + w] @ dw.T).reshape(-1)
            keep = np.argsort(-np.abs(coef), kind="stable")[: min(k, h * w)]
            kept = np.zeros_like(coef)
            kept[keep] = coef[keep]
            q[r : r + h, c : c + w] = dh.T @ kept.reshape(h, w) @ dw
    return q.reshape(shape)


def np_demo(n, grads, *, steps=STEPS, lr=LR, beta=BETA, chunk=CHUNK, k=K, sign=True, wd=0.0, skip=None):
    """Parameters after ``steps`` (the gradient of replica i at step t: grads[key][i, t] + params,
    the gradient of Σ ½p² + gᵀp), and each replica's momentum. ``skip``: (replica, step) whose
    gradient is non-finite."""
    params = {key: v.astype(np.float64) for key, v in start_params().items()}
    momenta = [{key: np.zeros_like(v) for key, v in params.items()} for _ in range(n)]
    for t in range(steps):
        qs = []
        for i in range(n):
            if (i, t) == skip:
                qs.append({key: np.zeros_like(v) for key, v in params.items()})
                continue
            m = {key: beta * momenta[i][key] + grads[key][i, t] + params[key] for key in params}
            q = {key: np_extract(m[key], chunk, k) for key in m}
            momenta[i] = {key: m[key] - q[key] for key in m}
            qs.append(q)
        for key in params:
            mean = sum(q[key] for q in qs) / n
            step = np.sign(mean) if sign else mean
            params[key] = params[key] - lr * (step + wd * params[key])
    return params, momenta


def run_demo(harness, grads, steps=STEPS, nan_at=None, **kw):
    settings = dict(momentum_decay=BETA, chunk_size=CHUNK, k=K) | kw
    tx = od.demo(LR, comm=harness.comm, **settings)

    def train(params, g):
        def body(carry, xs):
            params, state = carry
            t, gt = xs
            gt = jax.tree.map(jnp.add, gt, params)
            if nan_at is not None:
                poison = (harness.comm.index() == nan_at[0]) & (t == nan_at[1])
                gt = {**gt, "w": gt["w"] + jnp.where(poison, jnp.float32(jnp.nan), jnp.float32(0.0))}
            u, state = tx.update(gt, state, params)
            new = optax.apply_updates(params, u)
            return (new, state), (params, state.demo_momentum)

        steps_first = jax.tree.map(lambda x: x[:steps], g)
        (params, state), history = jax.lax.scan(
            body, (params, tx.init(params)), (jnp.arange(steps), steps_first)
        )
        return params, state, history

    return harness.run(train, od.replicate(jax.tree.map(jnp.asarray, start_params()), harness.n), grads)


def assert_close(got, want, atol=1e-5):
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=atol, rtol=0, err_msg=key)


# ---- the DCT -------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 7, 64])
def test_dct_is_orthonormal_and_scipys(n):
    d = dct_matrix(n)
    np.testing.assert_allclose(d @ d.T, np.eye(n), atol=1e-12)
    np.testing.assert_allclose(d, np_dct(n), atol=1e-12)
    x = np.random.default_rng(n).normal(size=(5, n)).astype(np.float32)
    back = jnp.asarray(x) @ jnp.asarray(d, jnp.float32).T @ jnp.asarray(d, jnp.float32)
    np.testing.assert_allclose(back, x, atol=1e-6)
    fft = pytest.importorskip("scipy.fft")
    np.testing.assert_allclose(
        x.astype(np.float64) @ d.T, fft.dct(x.astype(np.float64), norm="ortho"), atol=1e-12
    )


def test_block_dct_round_trip_and_scipys_2d_dct():
    x = np.random.default_rng(2).normal(size=(128, 96)).astype(np.float32)
    leaf = _leaf_plan(x.shape, 64, 5)
    assert (leaf.h, leaf.w, leaf.blocks, leaf.bits) == (64, 48, 4, 12)
    c = _coefficients(jnp.asarray(x), leaf)
    np.testing.assert_allclose(_values(c, leaf), x, atol=1e-5)
    fft = pytest.importorskip("scipy.fft")
    first = fft.dctn(x[:64, 48:].astype(np.float64), norm="ortho").reshape(-1)
    np.testing.assert_allclose(np.asarray(c)[1], first, atol=1e-4)  # block (0, 1)


def test_block_sides_are_the_references():
    # the largest divisor not above the chunk size; a side up to the chunk size is one block
    assert [block_side(n, 64) for n in (0, 1, 10, 64, 96, 128, 97, 50280, 4096)] == [
        1,
        1,
        10,
        64,
        48,
        64,
        1,
        60,
        64,
    ]


# ---- the algorithm -------------------------------------------------------------------------------


def test_matches_numpy_over_several_steps(harness):
    """With weight decay, and replica 2's gradient non-finite at step 1 (it keeps its momentum and
    sends zeros; the others' mean is still divided by W)."""
    grads = gradient_data(harness.n)
    params, state, _ = run_demo(harness, grads, weight_decay=0.1, nan_at=(2, 1))
    want, momenta = np_demo(harness.n, grads, wd=0.1, skip=(2, 1))
    assert all(np.isfinite(v).all() for v in params.values())
    assert_close(params, {key: np.broadcast_to(v, params[key].shape) for key, v in want.items()})
    for i in range(harness.n):
        assert_close({key: v[i] for key, v in state.demo_momentum.items()}, momenta[i])


def test_momentum_loses_exactly_what_was_sent():
    """Step by step, from the transform's own state: m_t = β m_(t−1) + g_t − q_t, with q_t the
    replica's extracted part (top-k DCT of β m_(t−1) + g_t), and (sign=False) the step applied is
    the replicas' mean of q_t; the whole trajectory is the NumPy transcription's."""
    harness = VmapHarness(8)
    grads = gradient_data(harness.n)
    final, state, (params, momenta) = run_demo(harness, grads, sign=False)
    want, _ = np_demo(harness.n, grads, sign=False)
    assert_close(final, {key: np.broadcast_to(v, final[key].shape) for key, v in want.items()})
    params = {key: np.concatenate([v, final[key][:, None]], axis=1) for key, v in params.items()}
    for t in range(1, STEPS):
        qs = []
        for i in range(harness.n):
            m = {key: BETA * momenta[key][i, t - 1] + grads[key][i, t] + params[key][i, t] for key in SHAPES}
            q = {key: np_extract(m[key].astype(np.float64), CHUNK, K) for key in m}
            assert_close({key: momenta[key][i, t] for key in SHAPES}, {key: m[key] - q[key] for key in m})
            assert all(np.abs(q[key]).max() > 1e-2 for key in q)  # every leaf sent something
            qs.append(q)
        step = {key: params[key][0, t + 1] - params[key][0, t] for key in SHAPES}
        assert_close(step, {key: -LR * sum(q[key] for q in qs) / harness.n for key in SHAPES})


def test_keeping_every_coefficient_is_allreduce_sgd():
    """k = chunk_size²: every block is sent whole, the momentum is emptied each step, and the
    update (sign=False) is SGD on the mean gradient."""
    grads = gradient_data(4)
    params, state, _ = run_demo(VmapHarness(4), grads, k=CHUNK * CHUNK, sign=False)
    want = {key: v.astype(np.float64) for key, v in start_params().items()}
    for t in range(STEPS):
        want = {key: want[key] - LR * (grads[key][:, t].mean(0) + want[key]) for key in want}
    assert_close({key: v[0] for key, v in params.items()}, want)
    assert max(np.abs(v).max() for v in state.demo_momentum.values()) < 1e-5


def test_defaults_and_bytes():
    """The defaults (64, 32 of each 64 × 64 block): a 64 × 128 kernel is 2 blocks of 32 12-bit
    indices and 32 float32 values (176 bytes each, per 4096 parameters); a 256-vector is 4 blocks
    of 64 with 32 6-bit indices."""
    harness = VmapHarness(4)
    tx = od.demo(1e-3, comm=harness.comm)
    rng = np.random.default_rng(0)
    params = od.replicate({"k": np.zeros((64, 128), np.float32), "v": np.zeros(256, np.float32)}, harness.n)
    g = {
        "k": rng.normal(size=(harness.n, 64, 128)).astype(np.float32),
        "v": rng.normal(size=(harness.n, 256)),
    }
    g["v"] = g["v"].astype(np.float32)

    def step(p, g):
        u, s = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, u), s

    new, state = harness.run(step, params, g)
    assert dict(od.comm_stats(state).by_kind) == {
        "all_gather[demo/32of64]": od.KindTotals(1, 2 * 176 + 4 * (24 + 128))
    }
    np.testing.assert_array_equal(new["k"], np.broadcast_to(new["k"][0], new["k"].shape))
    assert set(np.unique(np.abs(new["k"]))) <= {0.0, np.float32(1e-3)}


def test_an_empty_leaf_sends_nothing():
    harness = VmapHarness(2)
    tx = od.demo(0.1, comm=harness.comm, chunk_size=4, k=2)
    shapes = {"w": (2, 4), "none": (2, 0), "nil": (2, 0, 3)}
    g = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    u, state = harness.run(lambda g: tx.update(g, tx.init(g)), g)
    assert u["none"].shape == (2, 0) and u["nil"].shape == (2, 0, 3)
    only_w = harness.run(lambda g: tx.update(g, tx.init(g)), {"w": g["w"]})
    np.testing.assert_array_equal(u["w"], only_w[0]["w"])
    assert od.comm_stats(state).by_kind == od.comm_stats(only_w[1]).by_kind


def test_ledger_equals_compiled_all_gather():
    n = 4
    mesh = jax.make_mesh(
        (n,), ("replica",), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
    )
    tx = od.demo(0.1, comm=od.AxisComm("replica"), chunk_size=8, k=5)
    g = {key: v[:, 0] for key, v in gradient_data(n).items()}
    fn = od.on_mesh(lambda x: tx.update(x, tx.init(x)), mesh)
    stats = od.comm_stats(fn(g)[1])
    assert stats.collectives == 1
    sent = compiled_wire_bytes(fn, g)
    assert set(sent) == {"u8", "f32"}  # packed indices and values
    assert sum(sent.values()) == pytest.approx(ledger_wire_bytes(stats, n))


def test_bf16_and_float16_params_keep_their_dtype():
    tx = od.demo(0.01, comm=od.AxisComm(od.REPLICA_AXIS), chunk_size=4, k=2)
    p = od.replicate({"bf16": jnp.ones((4, 6), jnp.bfloat16), "f16": jnp.ones((5,), jnp.float16)}, 2)

    def step(q):
        u, s = tx.update(jax.tree.map(lambda x: x * 0.5, q), tx.init(q), q)
        return optax.apply_updates(q, u), s

    new, state = od.simulate(step)(p)
    assert new["bf16"].dtype == jnp.bfloat16 and new["f16"].dtype == jnp.float16
    assert all(m.dtype == jnp.float32 for m in state.demo_momentum.values())
    assert (np.asarray(new["f16"], np.float32) < 1).all()


def test_bad_settings_fail_at_construction():
    comm = od.AxisComm("replica")
    for kw, match in [
        (dict(chunk_size=1), "chunk_size=1"),
        (dict(k=0), "k=0"),
        (dict(chunk_size=4, k=17), "k=17"),
        (dict(momentum_decay=1.0), "momentum_decay=1.0"),
        (dict(momentum_decay=-0.1), "momentum_decay"),
        (dict(weight_decay=-1e-3), "weight_decay"),
        (dict(sign=1), "sign=1"),
        (dict(nonfinite="zero"), "nonfinite='zero'"),
    ]:
        with pytest.raises(ValueError, match=match):
            od.demo(0.1, comm=comm, **kw)
    for lr in (0.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="learning_rate=.* must be > 0"):
            od.demo(lr, comm=comm)
    od.demo(optax.constant_schedule(0.1), comm=comm)  # a schedule is taken as it is
    with pytest.raises(TypeError, match="comm"):
        od.demo(0.1, comm="replica")
