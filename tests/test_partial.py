"""SINGA partial averaging and Streaming DiLoCo."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import init_params, np_grad, replica_data
from tests.test_allreduce import LR, run_trajectory
from tests.test_local_sgd import close, sync_stats


def test_singa_partitions_pack_in_backward_order():
    params = {"a": jnp.zeros(5), "b": jnp.zeros(30), "c": jnp.zeros(4), "d": jnp.zeros(3)}
    # leaves a, b, c, d; backward order d, c, b, a; threshold 6: d+c=7 > 6 closes; b alone; a rest
    assert od.singa_partitions(params, threshold=6) == ((3, 2), (1,), (0,))
    assert od.balanced_fragments(params, 2) == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="num_fragments"):
        od.balanced_fragments(params, 5)


def np_partial(n, parts, steps):
    params = [{k: v.astype(np.float64) for k, v in init_params().items()} for _ in range(n)]
    names = sorted(params[0])  # leaf order of the dict: b, w
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        for i in range(n):
            g = np_grad(params[i], xs[t, i], ys[t, i])
            params[i] = {k: params[i][k] - LR * g[k] for k in g}
        for leaf in parts[t % len(parts)]:
            k = names[leaf]
            mean = sum(p[k] for p in params) / n
            for p in params:
                p[k] = mean.copy()
    return {k: np.stack([p[k] for p in params]) for k in names}


def test_partial_average_round_robin(harness):
    parts = ((1,), (0,))
    params, state = run_trajectory(
        harness, lambda c: od.partial_average(optax.sgd(LR), comm=c, partitions=parts), steps=5
    )
    close(params, np_partial(harness.n, parts, 5))
    stats = sync_stats(state)
    assert stats["all_reduce[partition0:float32]"] == od.KindTotals(3, 3 * 6 * 4)
    assert stats["all_reduce[partition1:float32]"] == od.KindTotals(2, 2 * 2 * 4)


def test_streaming_with_one_fragment_equals_diloco(harness):
    a, _ = run_trajectory(
        harness,
        lambda c: od.streaming_diloco(optax.sgd(LR), comm=c, period=4, num_fragments=1),
        steps=12,
    )
    b, _ = run_trajectory(harness, lambda c: od.diloco(optax.sgd(LR), comm=c, period=4), steps=12)
    close(a, b, atol=1e-6)


def np_streaming(n, period, frags, steps, delay, blend):
    """Outer sgd(1.0): a fragment's new anchor is the mean of its local values at its sync."""
    params = [{k: v.astype(np.float64) for k, v in init_params().items()} for _ in range(n)]
    names = sorted(params[0])
    stride = period // len(frags)
    xs, ys = replica_data(n, steps)
    pending = None
    for t in range(steps):
        for i in range(n):
            g = np_grad(params[i], xs[t, i], ys[t, i])
            params[i] = {k: params[i][k] - LR * g[k] for k in g}
        for f, leaves in enumerate(frags):
            if (t + 1 + f * stride) % period == 0:
                pending = (t + delay, {names[j]: sum(p[names[j]] for p in params) / n for j in leaves})
        if pending is not None and pending[0] == t:
            for p in params:
                for k, v in pending[1].items():
                    p[k] = blend * p[k] + (1 - blend) * v
            pending = None
    return {k: np.stack([p[k] for p in params]) for k in names}


@pytest.mark.parametrize("delay, blend", [(0, 0.0), (1, 0.5)])
def test_streaming_fragments_staggered_and_delayed(harness, delay, blend):
    period, frags = 4, ((0,), (1,))
    params, state = run_trajectory(
        harness,
        lambda c: od.streaming_diloco(
            optax.sgd(LR),
            optax.sgd(1.0),
            comm=c,
            period=period,
            num_fragments=2,
            delay=delay,
            blend=blend,
            fragments=frags,
        ),
        steps=11,
    )
    close(params, np_streaming(harness.n, period, frags, 11, delay, blend))
    stats = sync_stats(state)
    # fragment 0 syncs at t = 3, 7; fragment 1 at t = 1, 5, 9
    assert stats["all_reduce[fragment0:float32]"] == od.KindTotals(2, 2 * 2 * 4)
    assert stats["all_reduce[fragment1:float32]"] == od.KindTotals(3, 3 * 6 * 4)


def test_bad_arguments():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="num_fragments="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=10, num_fragments=3)
    with pytest.raises(ValueError, match="delay="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, delay=4)
    with pytest.raises(ValueError, match="blend="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, blend=1.0)
    tx = od.partial_average(optax.sgd(0.1), comm=comm, partitions=((0,),))
    with pytest.raises(ValueError, match="cover each"):
        tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})


def test_balanced_fragments_never_empty():
    params = [jnp.zeros(1000), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1)]
    frags = od.balanced_fragments(params, 3)
    assert frags == ((0,), (1,), (2, 3))
    assert od.balanced_fragments(params, 4) == ((0,), (1,), (2,), (3,))
