"""allreduce and average_params: trajectories against NumPy, options, accounting, cross-harness."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import grad_fn, init_params, np_grad, replica_data

STEPS, LR = 20, 0.1


def run_trajectory(harness, tx_factory, steps=STEPS, **update_kwargs):
    """Train the least-squares problem for ``steps`` with each replica on its own data."""
    n = harness.n
    tx = tx_factory(harness.comm)
    xs, ys = replica_data(n, steps)

    def train(params, x, y):
        state = tx.init(params)

        def body(carry, batch):
            p, s = carry
            g = grad_fn(p, *batch)
            u, s = tx.update(g, s, p, **update_kwargs)
            return (optax.apply_updates(p, u), s), None

        (params, state), _ = jax.lax.scan(body, (params, state), (x, y))
        return params, state

    params0 = od.replicate(jax.tree.map(jnp.asarray, init_params()), n)
    return harness.run(train, params0, np.swapaxes(xs, 0, 1), np.swapaxes(ys, 0, 1))


def np_allreduce_sgd(n, steps=STEPS, lr=LR, reduce=lambda gs: sum(gs) / len(gs)):
    params = {k: v.astype(np.float64) for k, v in init_params().items()}
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        grads = [np_grad(params, xs[t, i], ys[t, i]) for i in range(n)]
        for k in params:
            params[k] = params[k] - lr * reduce([g[k] for g in grads])
    return params


def n_param_elements():
    return sum(v.size for v in init_params().values())


def test_allreduce_sgd_matches_numpy_and_accounting(harness):
    params, state = run_trajectory(harness, lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(LR)))
    want = np_allreduce_sgd(harness.n)
    for k in want:
        np.testing.assert_allclose(params[k], np.broadcast_to(want[k], params[k].shape), atol=1e-5)
    od.assert_replicas_identical(params)
    # docstring formula: one all-reduce per step of sum(numel) elements of the gradient dtype
    stats = od.comm_stats(state)
    assert stats.by_kind == {"all_reduce[float32]": od.KindTotals(STEPS, STEPS * n_param_elements() * 4)}
    levels = od.comm_stats(state, levels=harness.comm)
    if harness.name != "node":
        assert levels == stats  # one level
        return
    # local reduce-scatter -> cross-node all-reduce of 1/G -> local all-gather, each leaf padded
    # to a multiple of the G devices of a node
    G = harness.hierarchy.local_size
    block = 4 * sum(-(-v.size // G) for v in init_params().values())
    assert levels.by_kind == {
        "local:all_reduce/reduce_scatter[float32]": od.KindTotals(STEPS, STEPS * G * block),
        "cross:all_reduce[float32]": od.KindTotals(STEPS, STEPS * block),
        "local:all_reduce/all_gather[float32]": od.KindTotals(STEPS, STEPS * block),
    }


@pytest.mark.against_vmap
def test_same_trajectory_on_every_harness(harness):
    """The 20 steps of allreduce + SGD give the same parameters as the vmap reference (1e-6)."""
    from tests.harness import VmapHarness

    factory = lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(LR, momentum=0.9))
    params, _ = run_trajectory(harness, factory)
    ref, _ = run_trajectory(VmapHarness(harness.n), factory)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], atol=1e-6, rtol=0)


@pytest.mark.parametrize("divide_before", [False, True])
def test_sum_and_custom_denominator(harness, divide_before):
    n = harness.n
    params, _ = run_trajectory(
        harness, lambda c: optax.chain(od.allreduce(comm=c, op="sum"), optax.sgd(LR)), steps=3
    )
    want = np_allreduce_sgd(n, steps=3, reduce=lambda gs: sum(gs))
    np.testing.assert_allclose(params["w"][0], want["w"], atol=1e-5)

    denom = 2.5 * n
    params, _ = run_trajectory(
        harness,
        lambda c: optax.chain(od.allreduce(comm=c, op="custom", divide_before=divide_before), optax.sgd(LR)),
        steps=3,
        denominator=denom,
    )
    want = np_allreduce_sgd(n, steps=3, reduce=lambda gs: sum(gs) / denom)
    np.testing.assert_allclose(params["w"][0], want["w"], atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_wire(harness, dtype):
    n = harness.n
    grads = np.random.default_rng(3).normal(size=(n, 7)).astype(np.float32)
    tx = od.allreduce(comm=harness.comm, dtype=dtype, clip_value=1.0)

    def step(g):
        u, s = tx.update(g, tx.init(g))
        return u, s

    out, state = harness.run(step, grads)
    rounded = np.clip(grads, -1, 1).astype(jnp.dtype(dtype)).astype(np.float32)
    want = rounded.sum(0) / n
    np.testing.assert_allclose(out[0], want, rtol=2e-2, atol=2e-2)
    assert not np.array_equal(out[0], np.clip(grads, -1, 1).mean(0))  # rounding did happen
    assert out.dtype == np.float32
    assert od.comm_stats(state).by_kind == {f"all_reduce[{dtype}]": od.KindTotals(1, 7 * 2)}


def test_narrow_wire_divides_first_by_default(harness):
    """float16 on the wire: each replica's share g/W is summed, so a mean in range stays finite;
    SINGA's order (sum, then divide) overflows on the same gradients."""
    n = harness.n
    g = np.random.default_rng(4).uniform(20000.0, 60000.0, size=(n, 64)).astype(np.float32)
    safe = od.allreduce(comm=harness.comm, dtype="float16")
    singa = od.allreduce(comm=harness.comm, dtype="float16", divide_before=False)
    mean, summed_first = harness.run(
        lambda x: (safe.update(x, safe.init(x))[0], singa.update(x, singa.init(x))[0]), g
    )
    np.testing.assert_allclose(mean[0], g.mean(0), rtol=2e-3)
    if n > 1:
        assert not np.isfinite(summed_first[0]).all()
    with pytest.raises(ValueError, match="divide_before='yes'; allowed: None, True, False"):
        od.allreduce(comm=harness.comm, divide_before="yes")


def test_average_params_equals_numpy(harness):
    """SGD with momentum locally, then parameter averaging: momentum buffers stay local."""
    n, steps, mom = harness.n, 5, 0.9
    params, state = run_trajectory(
        harness,
        lambda c: optax.chain(optax.sgd(LR, momentum=mom), od.average_params(comm=c)),
        steps=steps,
    )
    p = {k: v.astype(np.float64) for k, v in init_params().items()}
    xs, ys = replica_data(n, steps)
    bufs = [None] * n
    for t in range(steps):
        local = []
        for i in range(n):
            g = np_grad(p, xs[t, i], ys[t, i])
            bufs[i] = g if bufs[i] is None else {k: mom * bufs[i][k] + g[k] for k in g}
            local.append({k: p[k] - LR * bufs[i][k] for k in p})
        p = {k: sum(q[k] for q in local) / n for k in p}
    for k in p:
        np.testing.assert_allclose(params[k], np.broadcast_to(p[k], params[k].shape), atol=1e-5)
    stats = od.comm_stats(state)
    assert stats.by_kind == {"param_average[float32]": od.KindTotals(steps, steps * n_param_elements() * 4)}


def test_average_params_with_plain_sgd_equals_allreduce(harness):
    a, _ = run_trajectory(harness, lambda c: optax.chain(optax.sgd(LR), od.average_params(comm=c)))
    b, _ = run_trajectory(harness, lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(LR)))
    for k in a:
        np.testing.assert_allclose(a[k], b[k], atol=1e-6)


def test_mlbench_custom_centralized_clips_the_averaged_gradient(harness):
    """CustomCentralizedOptimizer(grad_clip=c) = chain(allreduce, clip_by_global_norm(c), sgd)."""
    n, clip = harness.n, 0.05
    params, _ = run_trajectory(
        harness,
        lambda c: optax.chain(od.allreduce(comm=c), optax.clip_by_global_norm(clip), optax.sgd(LR)),
        steps=4,
    )

    def clipped_mean(gs):
        return sum(gs) / len(gs)

    p = {k: v.astype(np.float64) for k, v in init_params().items()}
    xs, ys = replica_data(n, 4)
    for t in range(4):
        gs = [np_grad(p, xs[t, i], ys[t, i]) for i in range(n)]
        g = {k: clipped_mean([q[k] for q in gs]) for k in p}
        norm = np.sqrt(sum((v**2).sum() for v in g.values()))
        scale = min(1.0, clip / norm)
        p = {k: p[k] - LR * g[k] * scale for k in p}
    np.testing.assert_allclose(params["w"][0], p["w"], atol=1e-5)


def test_world_size_one_equals_inner_optimizer():
    from tests.harness import VmapHarness

    inner = lambda: optax.sgd(LR, momentum=0.9, nesterov=True)
    params, _ = run_trajectory(VmapHarness(1), lambda c: optax.chain(od.allreduce(comm=c), inner()))
    ref, _ = run_trajectory(VmapHarness(1), lambda c: inner())
    for k in ref:
        np.testing.assert_array_equal(params[k], ref[k])


def test_heat_dataparallel_blocking_equals_nonblocking_numbers(harness):
    """Heat casts each gradient to fp32, multiplies by 1/W and sums; both of its modes apply
    exactly that averaged gradient before the next forward, so both equal allreduce(divide_before)."""
    a, _ = run_trajectory(
        harness,
        lambda c: optax.chain(od.allreduce(comm=c, divide_before=True, dtype="float32"), optax.sgd(LR)),
    )
    want = np_allreduce_sgd(harness.n)
    np.testing.assert_allclose(a["w"][0], want["w"], atol=1e-5)


def test_bad_arguments_raise_at_construction():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="op="):
        od.allreduce(comm=comm, op="max")
    with pytest.raises(ValueError, match="dtype="):
        od.allreduce(comm=comm, dtype="int8")
    with pytest.raises(ValueError, match="clip_value="):
        od.allreduce(comm=comm, clip_value=-1.0)
    with pytest.raises(TypeError, match="comm"):
        od.allreduce(comm="replica")
    with pytest.raises(ValueError, match="dtype="):
        od.average_params(comm=comm, dtype="float64")


def test_custom_without_denominator_is_a_clear_error():
    tx = od.allreduce(comm=od.AxisComm("replica"), op="custom")
    g = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="denominator"):
        jax.vmap(lambda x: tx.update(x, tx.init(x))[0], axis_name="replica")(g)
