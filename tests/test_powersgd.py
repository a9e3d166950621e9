"""powersgd: invariants (full rank == all-reduce, sent + residual == input, no NaN), warm-up,
a NumPy trajectory, cross-harness agreement, accounting against the compiled HLO, edge cases."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.bench.cost import wire_bytes
from optaxdist.transforms.powersgd import PowerSgdState, orthonormalize, powersgd
from tests.harness import VmapHarness
from tests.problems import grad_fn, init_params, np_grad, replica_data
from tests.test_accounting import compiled_wire_bytes, hlo_collective_payloads

# leaf -> shape; matrix views: w (6, 4), k (6, 5); b and s are never compressed
SHAPES = {"w": (6, 4), "k": (2, 3, 5), "b": (4,), "s": ()}
F32_ROUND = 2.0**-24  # unit roundoff of float32


def make_grads(n, steps, seed=0, shapes=SHAPES):
    """Per-replica gradient sequences: leaf -> (n, steps, *shape) float32."""
    rng = np.random.default_rng(seed)
    return {k: rng.normal(size=(n, steps) + s).astype(np.float32) for k, s in shapes.items()}


def run_updates(harness, tx_factory, grads):
    """Feed each replica its gradient sequence; return per-step updates, residuals and Q's, the
    final state and the Q drawn by init (all stacked over replicas)."""
    tx = tx_factory(harness.comm)

    def train(g):
        state = tx.init(jax.tree.map(lambda x: x[0], g))

        def body(s, gt):
            u, s = tx.update(gt, s)
            return s, (u, s.powersgd_error, s.powersgd_q)

        final, (us, errors, qs) = jax.lax.scan(body, state, g)
        return us, errors, qs, final, state.powersgd_q

    return harness.run(train, grads)


def as_matrix(x):
    """The matrix view powersgd uses: all axes but the last are rows (per replica, per step)."""
    return x.reshape(x.shape[:2] + (-1, x.shape[-1]))


@pytest.mark.parametrize("warm_start", [False, True])
# warm start is each replica's own state (vmap has both; the mesh warm-starts in
# test_same_results_on_every_harness)
@pytest.mark.sample("False")
def test_full_rank_equals_allreduce_mean(harness, warm_start):
    grads = make_grads(harness.n, 3)
    us, errors, _, state, _ = run_updates(
        harness,
        lambda c: powersgd(comm=c, rank=6, warmup_steps=0, min_compression_rate=0.1, warm_start=warm_start),
        grads,
    )
    od.assert_replicas_identical(us)
    for k, g in grads.items():
        np.testing.assert_allclose(us[k], np.broadcast_to(g.mean(0), us[k].shape), atol=1e-5)
    # both matrices were compressed (full rank: r = min(n, m)); b and s were all-reduced exactly
    assert [e.shape[2:] for e in errors] == [(1, 6, 5), (1, 6, 4)]
    assert set(od.comm_stats(state).by_kind) == {
        "powersgd_p[float32]",
        "powersgd_q[float32]",
        "all_reduce[float32]",
    }
    # the residual of replica i is M_i − mean: nonzero, and it sums to zero over replicas
    assert np.abs(errors[1]).max() > 0.1
    np.testing.assert_allclose(errors[1].sum(0), 0, atol=1e-5)


def test_error_feedback_sent_plus_residual_is_input(harness):
    """u + e_new == g + e_old up to float32 rounding. u = fl(P̂Qᵀ), M = fl(g + e_old) and
    e_new = fl(M − P̂Qᵀ) (XLA may fuse the product into the subtraction, so e_new is rounded
    from the exact product, not from u): elementwise
    |u + e_new − (g + e_old)| ≤ 2⁻²⁴ (|u| + |e_new| + |g + e_old|)."""
    n, steps = harness.n, 3
    grads = make_grads(n, steps, seed=1)
    us, errors, _, _, _ = run_updates(harness, lambda c: powersgd(comm=c, warmup_steps=0), grads)
    # rank 1, rate 2: w (6, 4) and k (6, 5) are compressed; group order k, w (sorted leaf names)
    for gi, name in enumerate(["k", "w"]):
        g = as_matrix(grads[name]).astype(np.float64)
        u = as_matrix(us[name]).astype(np.float64)
        e = errors[gi][:, :, 0].astype(np.float64)
        e_old = np.concatenate([np.zeros_like(e[:, :1]), e[:, :-1]], axis=1)
        m = g + e_old
        bound = F32_ROUND * (np.abs(u) + np.abs(e) + np.abs(m)) * 1.01
        assert (np.abs(u + e - m) <= bound).all()
        assert np.abs(e).max() > 0.1  # a rank-1 approximation of random matrices is lossy
        for t in range(steps):
            assert np.linalg.matrix_rank(u[0, t], tol=1e-5) == 1
    np.testing.assert_allclose(us["b"], np.broadcast_to(grads["b"].mean(0), us["b"].shape), atol=1e-6)


@pytest.mark.parametrize("eps", [1e-8, 0.0])
@pytest.mark.sample("1e-08")  # the epsilon is each replica's orthogonalization's (vmap has both)
def test_zero_and_degenerate_gradients_give_no_nan(harness, eps):
    """Step 0: all zeros (P and the warm-started Q become zero). Step 1: the same rank-1 matrix
    with zero rows and columns on every replica, rank 3: exact (the spare columns of P̂ must be
    orthogonal to the first, and Q must restart from a fresh draw). Step 2: random."""
    n = harness.n
    grads = make_grads(n, 3, seed=2)
    for k in grads:
        grads[k][:, 0] = 0
    u_vec = np.array([1.0, 0, -2, 0, 3, 0.5], np.float32)
    grads["w"][:, 1] = np.outer(u_vec, [0.0, 2, 0, -1])
    grads["k"][:, 1] = np.outer(u_vec, [1.0, 0, 0, 2, 0]).reshape(2, 3, 5)
    us, errors, qs, _, _ = run_updates(
        harness,
        lambda c: powersgd(
            comm=c, rank=3, warmup_steps=0, min_compression_rate=0.1, orthogonalization_epsilon=eps
        ),
        grads,
    )
    for x in jax.tree.leaves((us, errors, qs)):
        assert np.isfinite(x).all()
    for k in grads:
        assert (us[k][:, 0] == 0).all()
    for k in ["w", "k"]:
        np.testing.assert_allclose(us[k][:, 1], grads[k][:, 1], atol=1e-5)
    assert all((q[:, 0] == 0).all() for q in qs)  # the warm start that step 1 had to replace
    assert np.abs(us["w"][:, 2]).max() > 0.1


def test_warmup_steps_are_exact_allreduce(harness):
    n, start = harness.n, 3
    grads = make_grads(n, 5, seed=3)
    us, errors, _, state, _ = run_updates(harness, lambda c: powersgd(comm=c, warmup_steps=start), grads)
    tx = od.allreduce(comm=harness.comm)
    exact = harness.run(lambda g: jax.lax.map(lambda gt: tx.update(gt, tx.init(gt))[0], g), grads)
    for k in grads:
        np.testing.assert_array_equal(us[k][:, :start], exact[k][:, :start])
    np.testing.assert_array_equal(us["b"], exact["b"])  # 1-D leaves are always exact
    assert not np.allclose(us["w"][:, start], exact["w"][:, start], atol=1e-3)
    for e in errors:
        assert (e[:, :start] == 0).all()
        assert np.abs(e[:, start]).max() > 0.1
    stats = od.comm_stats(state)
    all_bytes = 4 * (24 + 30 + 4 + 1)
    assert stats.by_kind == {
        "powersgd_p[float32]": od.KindTotals(2, 2 * 4 * (6 + 6)),
        "powersgd_q[float32]": od.KindTotals(2, 2 * 4 * (4 + 5)),
        "all_reduce[float32]": od.KindTotals(2, 2 * 4 * 5),
        "powersgd_warmup[float32]": od.KindTotals(start, start * all_bytes),
    }


def np_orth(a, eps=1e-8):
    """The Gram–Schmidt of the docs, in float64: two passes, zero if the norm is ≤ eps or the
    second pass removed more than half of it."""
    out = np.zeros_like(a)
    for i in range(a.shape[1]):
        v = a[:, i].copy()
        norms = []
        for _ in range(2):
            v = v - out @ (out.T @ v)
            norms.append(np.linalg.norm(v))
        out[:, i] = v / norms[1] if norms[1] > eps and norms[1] >= norms[0] / 2 else 0
    return out


def test_trajectory_matches_numpy(harness):
    """Least squares + SGD, rank 1, each replica on its own data, against a float64 NumPy
    PowerSGD started from the Q drawn by init: w (3×2) is compressed, b is averaged exactly."""
    n, steps, lr = harness.n, 8, 0.1
    kw = dict(rank=1, warmup_steps=0, min_compression_rate=1.0)  # (3 + 2)·1·1 < 3·2
    tx_factory = lambda c: optax.chain(powersgd(comm=c, **kw), optax.sgd(lr))
    xs, ys = replica_data(n, steps)
    tx = tx_factory(harness.comm)

    def train(params, x, y):
        def body(carry, batch):
            p, s = carry
            u, s = tx.update(grad_fn(p, *batch), s, p)
            return (optax.apply_updates(p, u), s), None

        (params, state), _ = jax.lax.scan(body, (params, tx.init(params)), (x, y))
        return params, state

    params0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)
    params, state = harness.run(train, params0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1))

    q = np.asarray(powersgd(comm=harness.comm, **kw).init(init_params()).powersgd_q[0][0], np.float64)
    p = {k: v.astype(np.float64) for k, v in init_params().items()}
    errors = [np.zeros((3, 2)) for _ in range(n)]
    for t in range(steps):
        gs = [np_grad(p, xs[t, i], ys[t, i]) for i in range(n)]
        ms = [g["w"] + e for g, e in zip(gs, errors)]
        q_hat = np_orth(q)
        p_hat = np_orth(sum(m @ q_hat for m in ms))
        q = sum(m.T @ p_hat for m in ms) / n
        approx = p_hat @ q.T
        errors = [m - approx for m in ms]
        p = {"w": p["w"] - lr * approx, "b": p["b"] - lr * sum(g["b"] for g in gs) / n}
    for k in p:
        np.testing.assert_allclose(params[k], np.broadcast_to(p[k], params[k].shape), atol=1e-5)
    od.assert_replicas_identical(params)
    assert od.comm_stats(state).by_kind == {
        "powersgd_p[float32]": od.KindTotals(steps, steps * 3 * 4),
        "powersgd_q[float32]": od.KindTotals(steps, steps * 2 * 4),
        "all_reduce[float32]": od.KindTotals(steps, steps * 2 * 4),
    }


@pytest.mark.against_vmap
@pytest.mark.parametrize("rank, rtol", [(1, 0.0), (2, 1e-5)])
def test_same_results_on_every_harness(harness, rank, rtol):
    """Agreement with the vmap reference to 1e-6. With rank ≥ 2 the Gram–Schmidt dot products
    may be summed in a different order on each backend: float32 rounding, amplified by the
    orthogonalization's conditioning, hence the 1e-5 relative tolerance there."""
    grads = make_grads(harness.n, 4, seed=4)
    factory = lambda c: powersgd(comm=c, rank=rank, warmup_steps=1, min_compression_rate=1.0)
    got = run_updates(harness, factory, grads)
    ref = run_updates(VmapHarness(harness.n), factory, grads)
    for a, b in zip(jax.tree.leaves(got[:3]), jax.tree.leaves(ref[:3])):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=rtol)


ACCOUNTING_SHAPES = {"w": (6, 4), "w2": (6, 4), "k": (2, 3, 5), "small": (3, 2), "b": (4,), "s": ()}


@pytest.mark.parametrize("dtype, warmup_steps", [("float32", 0), ("bfloat16", 0), ("float32", 5)])
def test_accounting_equals_formula_and_compiled_hlo(dtype, warmup_steps):
    """Rank 1, rate 2: w, w2 (batched together) and k are compressed; (3, 2) fails the rate test
    ((3 + 2)·1·2 ≥ 6) and goes with b and s through the exact all-reduce."""
    n = 8
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    tx = powersgd(comm=od.AxisComm("replica"), warmup_steps=warmup_steps)
    params = {k: jnp.ones((n,) + s, dtype) for k, s in ACCOUNTING_SHAPES.items()}
    fn = od.on_mesh(lambda g: tx.update(g, tx.init(g)), mesh)
    _, state = fn(params)
    itemsize = jnp.dtype(dtype).itemsize
    p_bytes, q_bytes = 4 * (6 + 6 + 6), 4 * (4 + 4 + 5)
    exact_bytes = itemsize * (6 + 4 + 1)
    warm_bytes = itemsize * (24 + 24 + 30 + 6 + 4 + 1)
    hlo = "f32" if dtype == "float32" else "u16"  # XLA:CPU would widen bf16: the bits are sent
    kinds = {
        "powersgd_p[float32]": p_bytes,
        "powersgd_q[float32]": q_bytes,
        f"all_reduce[{dtype}]": exact_bytes,
    }
    if warmup_steps:
        kinds[f"powersgd_warmup[{dtype}]"] = warm_bytes
    ledger = jax.tree.map(lambda c: c[0], state.powersgd_ledger)
    assert dict(zip(ledger.kinds, ledger.payloads)) == kinds
    sent = compiled_wire_bytes(fn, params)
    text = fn.lower(params).as_text(dialect="hlo")
    n_all_reduce = len(re.findall(r"\ball-reduce(?:-start)?\(", text))
    if warmup_steps == 0:
        assert od.comm_stats(state).by_kind == {k: od.KindTotals(1, b) for k, b in kinds.items()}
        want = {"f32": wire_bytes("all_reduce", p_bytes + q_bytes, n)}
        # a bfloat16 sum on XLA:CPU pads the 11 values to a multiple of n (16) for its reduce-scatter
        padded = exact_bytes if dtype == "float32" else -(-11 // n) * n * itemsize
        want[hlo] = want.get(hlo, 0) + wire_bytes("all_reduce", padded, n)
        assert sent == pytest.approx(want)
        # P, Q, the uncompressed leaves: each fused into one (bf16 ones: reduce-scatter + gather)
        assert n_all_reduce == (3 if dtype == "float32" else 2)
    else:  # a warm-up step; the program holds both branches of the cond
        assert od.comm_stats(state).by_kind == {
            k: od.KindTotals(int("warmup" in k), b * ("warmup" in k)) for k, b in kinds.items()
        }
        assert hlo_collective_payloads(fn, params) == {"f32": sum(kinds.values())}
        assert n_all_reduce == 4


def test_batching_same_shapes_changes_nothing_but_the_kernels():
    grads = make_grads(4, 3, seed=5, shapes=ACCOUNTING_SHAPES)
    harness = VmapHarness(4)
    kw = dict(rank=2, warmup_steps=0, min_compression_rate=1.0)
    a = run_updates(harness, lambda c: powersgd(comm=c, **kw), grads)
    b = run_updates(harness, lambda c: powersgd(comm=c, batch_same_shape=False, **kw), grads)
    assert [q.shape[1:] for q in a[4]] == [(1, 5, 2), (2, 4, 2)]
    assert [q.shape[1:] for q in b[4]] == [(1, 5, 2), (1, 4, 2), (1, 4, 2)]
    for k in grads:
        np.testing.assert_allclose(a[0][k], b[0][k], atol=1e-6, rtol=0)
    assert od.comm_stats(a[3]) == od.comm_stats(b[3])


def test_world_size_one():
    """One replica: the identity by default (mlbench; nothing is sent); PyTorch's compression
    with compress_single_replica=True."""
    grads = make_grads(1, 2, seed=6)
    harness = VmapHarness(1)
    us, errors, qs, state, q0 = run_updates(harness, lambda c: powersgd(comm=c, warmup_steps=0), grads)
    for k in grads:
        np.testing.assert_array_equal(us[k], grads[k])
    assert all((e == 0).all() for e in errors)
    for q, q_init in zip(qs, q0):
        np.testing.assert_array_equal(q[:, -1], q_init)
    assert od.comm_stats(state).collectives == 0

    us, errors, _, state, _ = run_updates(
        harness, lambda c: powersgd(comm=c, warmup_steps=0, compress_single_replica=True), grads
    )
    assert np.linalg.matrix_rank(us["w"][0, 0], tol=1e-5) == 1
    e_w = errors[1][0, 0, 0]
    np.testing.assert_allclose(us["w"][0, 0] + e_w, grads["w"][0, 0], atol=1e-6)
    np.testing.assert_array_equal(us["b"], grads["b"])
    assert od.comm_stats(state).by_kind["powersgd_p[float32]"].collectives == 2


def test_state_on_abstract_shapes_and_bf16_keeps_dtype():
    tx = powersgd(comm=od.AxisComm("replica"), warmup_steps=1)
    params = {k: jnp.ones(s, jnp.bfloat16) for k, s in SHAPES.items()}
    abstract = jax.eval_shape(tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
    concrete = tx.init(params)
    assert isinstance(concrete, PowerSgdState)
    spec = lambda t: [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(t)]
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert spec(abstract) == spec(concrete)
    assert all(e.dtype == jnp.float32 for e in concrete.powersgd_error)

    grads = make_grads(2, 3, seed=7)
    grads = {k: v.astype(jnp.bfloat16) for k, v in grads.items()}
    us, errors, qs, state, _ = run_updates(VmapHarness(2), lambda c: tx, grads)
    assert all(u.dtype == jnp.bfloat16 for u in jax.tree.leaves(us))
    assert spec(jax.tree.map(lambda x: x[0], state)) == spec(concrete)
    # the residual is taken against the bf16 update actually returned
    g, u = as_matrix(grads["w"]).astype(np.float32), as_matrix(us["w"]).astype(np.float32)
    e_old = np.concatenate([np.zeros_like(errors[1][:, :1, 0]), errors[1][:, :-1, 0]], axis=1)
    np.testing.assert_allclose(u[:, 1:] + errors[1][:, 1:, 0], (g + e_old)[:, 1:], atol=1e-5)


@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_orthonormalize_is_orthonormal_or_zero(eps):
    rng = np.random.default_rng(8)
    a = rng.normal(size=(4, 7, 4)).astype(np.float32)
    a[0, :, 2] = a[0, :, 0] * 3 - a[0, :, 1]  # numerically dependent column
    a[1, :, 1] = 0  # zero column
    a[2] = 0
    a[3] = np.outer(rng.normal(size=7), rng.normal(size=4))  # rank 1: P of a rank-1 gradient
    out, kept = map(np.asarray, orthonormalize(jnp.asarray(a), eps))
    assert np.isfinite(out).all()
    assert kept[1].tolist() == [True, False, True, True] and not kept[2].any()
    assert kept[3, 0] and not kept[0, 2]
    for b in range(4):
        gram = out[b].T @ out[b]
        np.testing.assert_allclose(gram, np.diag(kept[b].astype(np.float32)), atol=1e-6)


def test_bad_hyperparameters_raise_at_construction():
    comm = od.AxisComm("replica")
    for kw, match in [
        (dict(rank=0), "rank="),
        (dict(rank=1.5), "rank="),
        (dict(rank=True), "rank="),
        (dict(warmup_steps=-1), "warmup_steps="),
        (dict(warmup_steps=2.0), "warmup_steps="),
        (dict(min_compression_rate=0), "min_compression_rate="),
        (dict(min_compression_rate=-2.0), "min_compression_rate="),
        (dict(min_compression_rate=float("nan")), "min_compression_rate="),
        (dict(orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon="),
        (dict(seed=0.5), "seed="),
        (dict(warm_start=1), "warm_start="),
    ]:
        with pytest.raises(ValueError, match=match):
            powersgd(comm=comm, **kw)
    with pytest.raises(TypeError, match="comm"):
        powersgd(comm="replica")


def test_gradients_that_do_not_match_init_are_a_clear_error():
    tx = powersgd(comm=od.AxisComm("replica"), warmup_steps=0)
    state = tx.init({"w": jnp.ones((6, 4))})
    with pytest.raises(ValueError, match="do not match"):
        jax.vmap(lambda g: tx.update(g, state)[0], axis_name="replica")({"w": jnp.ones((2, 8, 4))})
