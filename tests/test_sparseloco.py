"""SparseLoCo: DiLoCo with chunked top-k pseudo-gradients, a decaying error-feedback buffer and an
outer SGD step."""

import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import init_params, np_grad, replica_data
from tests.test_allreduce import LR, run_trajectory
from tests.test_chunked_top_k import numpy_chunked_top_k
from tests.test_local_sgd import close, sync_stats

STEPS, PERIOD = 12, 3


def np_sparseloco(n, *, chunk, k, decay, outer_lr, steps=STEPS, period=PERIOD):
    anchor = {key: v.astype(np.float64) for key, v in init_params().items()}
    params = [dict(anchor) for _ in range(n)]
    error = [{key: np.zeros_like(v) for key, v in anchor.items()} for _ in range(n)]
    xs, ys = replica_data(n, steps)
    for t in range(steps):
        for i in range(n):
            g = np_grad(params[i], xs[t, i], ys[t, i])
            params[i] = {key: params[i][key] - LR * g[key] for key in g}
        if (t + 1) % period == 0:
            sent = []
            for i in range(n):
                v = {key: anchor[key] - params[i][key] + decay * error[i][key] for key in anchor}
                s = {key: numpy_chunked_top_k(v[key], chunk, k) for key in v}
                error[i] = {key: v[key] - s[key] for key in v}
                sent.append(s)
            anchor = {key: anchor[key] - outer_lr * sum(s[key] for s in sent) / n for key in anchor}
            params = [dict(anchor) for _ in range(n)]
    return {key: np.stack([p[key] for p in params]) for key in anchor}


def test_matches_numpy_and_sends_the_packed_bytes(harness):
    settings = dict(chunk_size=4, k=1, value_bits=None, error_decay=0.5, outer_lr=0.8)
    params, state = run_trajectory(
        harness, lambda c: od.sparseloco(optax.sgd(LR), comm=c, period=PERIOD, **settings), steps=STEPS
    )
    want = np_sparseloco(harness.n, chunk=4, k=1, decay=0.5, outer_lr=0.8)
    close(params, want)
    syncs = STEPS // PERIOD
    # w: 6 values in 2 chunks, b: 2 values in 1 chunk; one 2-bit index and one float32 per chunk
    per_sync = (1 + 4 * 2) + (1 + 4)
    assert sync_stats(state) == {"all_gather[chunked_top_k/1of4]": od.KindTotals(syncs, syncs * per_sync)}


def test_defaults_are_the_papers_and_send_116_bytes_per_4096_values(harness):
    tx = od.sparseloco(optax.sgd(0.1, momentum=0.9), comm=harness.comm, period=1)
    rng = np.random.default_rng(0)
    params = od.replicate({"w": rng.normal(size=(2, 4096)).astype(np.float32)}, harness.n)
    grads = rng.normal(size=(harness.n, 2, 4096)).astype(np.float32)

    def one_sync(p, g):
        u, s = tx.update({"w": g}, tx.init(p), p)
        return optax.apply_updates(p, u), s

    new, state = harness.run(one_sync, params, grads)
    # 2 chunks, each 64 indices of 12 bits, 64 values of 2 bits and one float32 scale
    stats = dict(od.comm_stats(state).by_kind)
    stats.pop("broadcast[start check]")
    assert stats == {"all_gather[chunked_top_k/64of4096,int2/64]": od.KindTotals(1, 2 * 116)}
    moved = new["w"] != params["w"]
    assert 0 < moved[0].sum() <= harness.n * 2 * 64  # at most the union of what the replicas sent
    np.testing.assert_array_equal(new["w"], np.broadcast_to(new["w"][0], new["w"].shape))


def test_bad_settings_fail_at_construction():
    comm = od.AxisComm("replica")
    inner = optax.sgd(0.1)
    with pytest.raises(ValueError, match="value_bits=3"):
        od.sparseloco(inner, comm=comm, value_bits=3)
    with pytest.raises(ValueError, match="k=6 must be a multiple of 4"):
        od.sparseloco(inner, comm=comm, k=6)
    with pytest.raises(ValueError, match="error_decay"):
        od.sparseloco(inner, comm=comm, error_decay=1.5)
    with pytest.raises(ValueError, match="outer_lr"):
        od.sparseloco(inner, comm=comm, outer_lr=0.0)
    with pytest.raises(ValueError, match="k=8192"):
        od.sparseloco(inner, comm=comm, k=8192)
    with pytest.raises(ValueError, match="error_decay=0.9 needs error_feedback=True"):
        od.compressed_allreduce(od.compress.top_k(count=1), comm=comm, error_feedback=False, error_decay=0.9)
