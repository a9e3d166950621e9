"""SparseLoCo: DiLoCo with chunked top-k pseudo-gradients, a decaying error-feedback buffer and an
outer SGD step."""

import jax
import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import init_params, np_grad, replica_data
from tests.test_allreduce import LR, run_trajectory
from tests.test_chunked_top_k import numpy_chunked_top_k
from tests.test_local_sgd import close, sync_stats

STEPS, PERIOD = 12, 3


def packed_top_k(v, chunk, k):
    """Chunked top-k of the leaves smaller than ``chunk`` concatenated in tree order (sorted keys),
    of the others leaf by leaf."""
    small = [key for key in sorted(v) if v[key].size < chunk]
    out = {key: numpy_chunked_top_k(v[key], chunk, k) for key in v if key not in small}
    if small:
        flat = numpy_chunked_top_k(np.concatenate([v[key].reshape(-1) for key in small]), chunk, k)
        offset = 0
        for key in small:
            out[key] = flat[offset : offset + v[key].size].reshape(v[key].shape)
            offset += v[key].size
    return out


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
                s = packed_top_k(v, chunk, k)
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


# the outer step is each replica's own: the mesh in the full run
@pytest.mark.sample()
def test_outer_replaces_the_outer_sgd(harness):
    # outer_lr keeps its default (1.0): the trajectory is the NumPy model's only if outer's 0.8 is used
    settings = dict(chunk_size=4, k=1, value_bits=None, error_decay=0.5, outer=optax.sgd(0.8))
    params, _ = run_trajectory(
        harness, lambda c: od.sparseloco(optax.sgd(LR), comm=c, period=PERIOD, **settings), steps=STEPS
    )
    close(params, np_sparseloco(harness.n, chunk=4, k=1, decay=0.5, outer_lr=0.8))


# packing is each replica's own; the mesh packs in test_matches_numpy_and_sends_the_packed_bytes
@pytest.mark.sample()
def test_small_leaves_are_packed_into_one_vector(harness):
    """chunk 8: w (6 values) and b (2) are both smaller than a chunk, so they travel as one vector of
    8 values (one chunk, b first); without packing each leaf pads a chunk of its own."""
    settings = dict(chunk_size=8, k=2, value_bits=None, error_decay=0.9, outer_lr=1.0)
    params, state = run_trajectory(
        harness, lambda c: od.sparseloco(optax.sgd(LR), comm=c, period=PERIOD, **settings), steps=STEPS
    )
    close(params, np_sparseloco(harness.n, chunk=8, k=2, decay=0.9, outer_lr=1.0))
    syncs = STEPS // PERIOD
    per_sync = 1 + 4 * 2  # 2 indices of 3 bits, 2 float32 values
    assert sync_stats(state) == {"all_gather[chunked_top_k/2of8]": od.KindTotals(syncs, syncs * per_sync)}
    _, state = run_trajectory(
        harness,
        lambda c: od.sparseloco(optax.sgd(LR), comm=c, period=PERIOD, pack_small_leaves=False, **settings),
        steps=STEPS,
    )
    assert sync_stats(state) == {"all_gather[chunked_top_k/2of8]": od.KindTotals(syncs, syncs * 2 * per_sync)}


def one_sync_stats(harness, **kw):
    tx = od.sparseloco(optax.sgd(0.1, momentum=0.9), comm=harness.comm, period=1, **kw)
    rng = np.random.default_rng(0)
    tree = {
        "w": rng.normal(size=(2, 4096)).astype(np.float32),
        "b": rng.normal(size=(3, 100)).astype(np.float32),
    }
    params = od.replicate(tree, harness.n)
    grads = {k: rng.normal(size=(harness.n, *v.shape)).astype(np.float32) for k, v in tree.items()}

    def one_sync(p, g):
        u, s = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, u), s

    new, state = harness.run(one_sync, params, grads)
    for key in tree:
        moved = new[key] != params[key]
        assert 0 < moved[0].sum() <= harness.n * moved[0].size  # something moved
        np.testing.assert_array_equal(new[key], np.broadcast_to(new[key][0], new[key].shape))
    assert (new["w"][0] != params["w"][0]).sum() <= harness.n * 2 * 64  # the union of what was sent
    return sync_stats(state)


def test_defaults_are_the_papers_and_send_128_bytes_per_4096_values(harness):
    # w: 2 chunks; b (300 values, smaller than a chunk) packed alone: 1 chunk. Each chunk: 64
    # indices of 12 bits, 64 values of 2 bits and the table of the 4 bins' centroids (float32)
    assert one_sync_stats(harness) == {
        "all_gather[chunked_top_k/64of4096,int2/64,sigma6]": od.KindTotals(1, 3 * (96 + 16 + 16))
    }


# the mesh runs the same sync in test_defaults_are_the_papers_and_send_128_bytes_per_4096_values
@pytest.mark.sample()
def test_absmax_values_send_one_scale_per_chunk(harness):
    assert one_sync_stats(harness, value_scale="absmax") == {
        "all_gather[chunked_top_k/64of4096,int2/64]": od.KindTotals(1, 3 * (96 + 16 + 4))
    }


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
    with pytest.raises(TypeError, match="outer must be an optax.GradientTransformation, got 0.5"):
        od.sparseloco(inner, comm=comm, outer=0.5)
    with pytest.raises(TypeError, match="outer must be an optax.GradientTransformation, got 'nesterov'"):
        od.diloco(inner, "nesterov", comm=comm, period=2)
    with pytest.raises(TypeError, match="inner must be an optax.GradientTransformation, got 0.1"):
        od.local_sgd(0.1, comm=comm, period=2)
    with pytest.raises(ValueError, match="outer_lr=0.5 is SGD's learning rate"):
        od.sparseloco(inner, comm=comm, outer_lr=0.5, outer=optax.sgd(0.5))
    with pytest.raises(ValueError, match="value_scale='max'"):
        od.sparseloco(inner, comm=comm, value_scale="max")
    with pytest.raises(ValueError, match="pack_small_leaves=1"):
        od.sparseloco(inner, comm=comm, pack_small_leaves=1)
    sharding = od.ModelSharding({"w": jax.sharding.PartitionSpec("model")}, (("model", 2),))
    with pytest.raises(ValueError, match="pack_small_leaves=True can't be combined with model_sharding"):
        od.sparseloco(inner, comm=comm, pack_small_leaves=True, model_sharding=sharding)
    with pytest.raises(ValueError, match="k=8192"):
        od.sparseloco(inner, comm=comm, k=8192)
    with pytest.raises(ValueError, match="error_decay=0.9 needs error_feedback=True"):
        od.compressed_allreduce(od.compress.top_k(count=1), comm=comm, error_feedback=False, error_decay=0.9)
