"""SINGA partial averaging and Streaming DiLoCo."""

import functools
import re

import jax
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


@pytest.mark.parametrize("delay", [1, 3])
@pytest.mark.sample("3")  # the delay is each replica's schedule: vmap has both
def test_overlap_gives_the_numbers_of_the_all_reduce_at_the_sync(harness, delay):
    """``overlap``: each fragment's all-reduce spread over the ``delay`` steps after its sync, one
    chunk per step, the outer step taken at the merge: the numbers of the all-reduce at the sync.
    The ledger counts one chunk on every step (of the largest fragment: ``w``, 6 elements)."""
    period, frags = 8, ((0,), (1,))

    def make(overlap):
        return lambda c: od.streaming_diloco(
            optax.sgd(LR),
            comm=c,
            period=period,
            num_fragments=2,
            delay=delay,
            blend=0.5,
            fragments=frags,
            overlap=overlap,
        )

    a, state = run_trajectory(harness, make(True), steps=21)
    b, _ = run_trajectory(harness, make(False), steps=21)
    close(a, b, atol=1e-6)
    chunk = -(-6 // delay)
    assert sync_stats(state) == {"overlapped_all_reduce[float32]": od.KindTotals(21, 21 * chunk * 4)}


def test_overlap_is_bitwise_the_all_reduce_at_the_sync_with_16_bit_leaves():
    """Under ``simulate``, bit for bit; a bfloat16 leaf (float32 anchor) goes on the wire as
    bfloat16, divided before the sum, as ``pmean`` sends it; the all-reduce that completes a
    fragment on its merge step and the first one after a sync included (delay = H/F − 1)."""
    params = {
        "a": jnp.linspace(-1, 1, 37 * 5).reshape(37, 5),
        "b": jnp.linspace(0, 1, 11).astype(jnp.bfloat16),
    }
    comm = od.AxisComm("replica")

    def run(overlap):
        tx = od.streaming_diloco(
            optax.sgd(0.01, momentum=0.9),
            comm=comm,
            period=8,
            num_fragments=2,
            delay=3,
            blend=0.5,
            overlap=overlap,
        )

        def step(p, s, t):
            me = jax.lax.axis_index("replica").astype(jnp.float32)
            g = jax.tree.map(lambda x: jnp.sin(3 * x.astype(jnp.float32) + me + t).astype(x.dtype), p)
            u, s = tx.update(g, s, p)
            return od.apply_updates(p, u, s), s

        run_step = od.simulate(step)
        p = od.replicate(params, 4)
        s = jax.vmap(tx.init)(p)
        for t in range(19):
            p, s = run_step(p, s, jnp.full((4,), t, jnp.float32))
        return p, s

    (a, state), (b, _) = run(True), run(False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    # one chunk per step: a quarter of "a" (185 floats, rounded up) and of "b" (11 bfloat16)
    stats = od.comm_stats(jax.tree.map(lambda x: x[0], state)).by_kind
    assert stats["overlapped_all_reduce[bfloat16+float32]"] == od.KindTotals(19, 19 * (62 * 4 + 4 * 2))


@functools.cache
def _overlapped_streaming_step():
    """One transform and one simulated step for every case below: each replica count compiles once."""
    tx = od.streaming_diloco(
        optax.sgd(0.05, momentum=0.9),
        comm=od.AxisComm("replica"),
        period=8,
        num_fragments=2,
        delay=3,
        blend=0.5,
        overlap=True,
    )

    def step(p, s, t):
        g = jax.tree.map(lambda x: jnp.cos(2 * x.astype(jnp.float32) + t).astype(x.dtype), p)
        u, s = tx.update(g, s, p)
        return od.apply_updates(p, u, s), s

    return tx, od.simulate(step)


@pytest.mark.parametrize("steps_before", [6, 9, 10])
def test_overlap_resized_while_a_chunk_is_in_flight(steps_before):
    """``resize_replicas`` from 4 to 2 replicas in the middle of an overlapped all-reduce: the
    bfloat16 fragment ``b`` (synced at step 3, divided before its sum) after step 5, the float32
    fragment ``a`` (synced at step 7) after steps 8 and 9. With every replica on the same
    gradients, the run continues as a 2-replica run from the start would: the chunks on the wire
    are rescaled for 2."""
    params = {"a": jnp.linspace(-1, 1, 24).reshape(4, 6), "b": jnp.linspace(0, 1, 8).astype(jnp.bfloat16)}
    tx, run_step = _overlapped_streaming_step()

    def run(p, s, n, steps):
        for t in steps:
            p, s = run_step(p, s, jnp.full((n,), t, jnp.float32))
        return p, s

    p4 = od.replicate(params, 4)
    p4, s4 = run(p4, jax.vmap(tx.init)(p4), 4, range(steps_before))
    p2, s2 = od.resize_replicas(p4, s4, 2)
    resized, _ = run(p2, s2, 2, range(steps_before, 16))
    p2 = od.replicate(params, 2)
    want, _ = run(p2, jax.vmap(tx.init)(p2), 2, range(16))
    for x, y in zip(jax.tree.leaves(resized), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-2, atol=1e-5)


def test_overlap_all_reduce_reads_and_writes_only_step_arguments_and_results():
    """What lets XLA run the all-reduce while the step computes its gradients: it is outside
    every conditional, it reads an argument of the step and its result is a result of the step
    (an intermediate's buffer would be shared with the gradients' computation, which would then
    wait for it)."""
    comm = od.AxisComm("replica")
    tx = od.streaming_diloco(optax.sgd(0.1), comm=comm, period=10, num_fragments=1, delay=9, overlap=True)
    params = {"w": jnp.ones((30, 30)), "b": jnp.ones(30)}

    def step(p, s):
        g = jax.grad(lambda p: jnp.sum(jnp.tanh(p["w"] @ p["b"])))(p)
        u, s = tx.update(g, s, p)
        return od.apply_updates(p, u, s), s

    mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("replica"))
    p = od.replicate(params, 2)
    p, s = jax.device_put((p, jax.vmap(tx.init)(p)), rows)
    hlo = od.on_mesh(step, mesh, donate_argnums=(0, 1)).lower(p, s).compile().as_text()
    entry = hlo[hlo.index("\nENTRY") :]
    chunk = f"f32[{-(-930 // 9)}]"
    # operands only: the slice that overwrites the donated ``outgoing`` waits for the all-reduce
    # that reads it (a control predecessor), which is not a use of its result
    defs = {
        n: re.sub(r"control-predecessors=\{[^}]*\}", "", r) for n, r in re.findall(r"%(\S+) = (.*)", entry)
    }
    reduces = [name for name, rhs in defs.items() if rhs.startswith(chunk) and " all-reduce(" in rhs]
    assert len(reduces) == 1, reduces  # in the entry computation, not in a branch
    operand = re.search(r"all-reduce\(%([\w.\-]+)", defs[reduces[0]]).group(1)
    while " bitcast(" in defs.get(operand, ""):
        operand = re.search(r"bitcast\(%([\w.\-]+)", defs[operand]).group(1)
    assert " parameter(" in defs[operand], defs[operand]
    users = [n for n, rhs in defs.items() if re.search(rf"%{re.escape(reduces[0])}\b", rhs)]
    for user in users:
        while user in defs and " bitcast(" in defs[user]:
            user = [n for n, rhs in defs.items() if re.search(rf"%{re.escape(user)}\b", rhs)][0]
        assert user not in defs or " tuple(" in defs[user], defs.get(user)


def test_bad_arguments():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="num_fragments="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=10, num_fragments=3)
    with pytest.raises(ValueError, match="delay="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, delay=4)
    with pytest.raises(ValueError, match="blend="):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, blend=1.0)
    for bad in ({}, {"delay": 1, "num_shards": 2}, {"delay": 1, "reducer": od.allreduce(comm=comm)}):
        with pytest.raises(ValueError, match="overlap=True"):
            od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, overlap=True, **bad)
    with pytest.raises(ValueError, match="overlap=1"):
        od.streaming_diloco(optax.sgd(0.1), comm=comm, period=8, num_fragments=2, delay=1, overlap=1)
    tx = od.partial_average(optax.sgd(0.1), comm=comm, partitions=((0,),))
    with pytest.raises(ValueError, match="cover each"):
        tx.init({"a": jnp.zeros(2), "b": jnp.zeros(2)})


def test_balanced_fragments_never_empty():
    params = [jnp.zeros(1000), jnp.zeros(1), jnp.zeros(1), jnp.zeros(1)]
    frags = od.balanced_fragments(params, 3)
    assert frags == ((0,), (1,), (2, 3))
    assert od.balanced_fragments(params, 4) == ((0,), (1,), (2,), (3,))


@pytest.mark.parametrize("delay", [0, 1])
@pytest.mark.sample("1")  # the delay is each replica's schedule: vmap has both
def test_streaming_sharded_equals_unsharded(harness, delay):
    """num_shards: each fragment's anchor and outer state sharded; the new anchor is all-gathered at
    the merge. Nesterov outer steps are element-wise: the same numbers."""
    n, period, frags = harness.n, 4, ((0,), (1,))

    def make(num_shards):
        return lambda c: od.streaming_diloco(
            optax.sgd(LR),
            comm=c,
            period=period,
            num_fragments=2,
            delay=delay,
            fragments=frags,
            num_shards=num_shards,
        )

    a, state = run_trajectory(harness, make(n), steps=11)
    b, _ = run_trajectory(harness, make(None), steps=11)
    close(a, b, atol=1e-6)
    blocks = [-(-2 // n), -(-6 // n)]  # b: 2 elements, w: 6
    syncs = [2, 3]  # fragment 0 syncs at t = 3, 7; fragment 1 at t = 1, 5, 9; each merges delay later
    expected = {}
    for f in (0, 1):
        expected[f"reduce_scatter[fragment{f}:float32]"] = od.KindTotals(
            syncs[f], syncs[f] * blocks[f] * n * 4
        )
        expected[f"all_gather[fragment{f}:float32]"] = od.KindTotals(syncs[f], syncs[f] * blocks[f] * 4)
    assert sync_stats(state) == expected


def test_streaming_with_a_reducer(harness):
    """Any averaging transformation reduces each fragment's pseudo-gradient, with its own state:
    ``allreduce`` gives the default's numbers, top-k with error feedback keeps a residual per fragment."""
    make = lambda reducer: (
        lambda c: od.streaming_diloco(
            optax.sgd(LR), comm=c, period=4, num_fragments=2, reducer=reducer(c) if reducer else None
        )
    )
    a, _ = run_trajectory(harness, make(lambda c: od.allreduce(comm=c)), steps=11)
    b, _ = run_trajectory(harness, make(None), steps=11)
    close(a, b, atol=0)
    params, state = run_trajectory(
        harness, make(lambda c: od.compressed_allreduce(od.compress.top_k(fraction=0.5), comm=c)), steps=11
    )
    assert np.isfinite(params["w"]).all()
    assert sync_stats(state) == {"all_gather[top_k]": od.KindTotals(5, 2 * (1 * 8) + 3 * (3 * 8))}
    residuals = [r.error for r in state.sync_state.reducer_states]
    assert [len(jax.tree.leaves(r)) for r in residuals] == [1, 1]


def test_diloco_warmup_equals_local_sgd_warmup(harness):
    """The engine's warm-up (gradients all-reduced, then the anchor taken) works for DiLoCo too:
    with outer sgd(1) it is post-local SGD."""
    a, state = run_trajectory(
        harness,
        lambda c: od.diloco(optax.sgd(LR), optax.sgd(1.0), comm=c, period=3, warmup_steps=2),
        steps=11,
    )
    b, _ = run_trajectory(
        harness, lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=3, warmup_steps=2), steps=11
    )
    close(a, b, atol=1e-6)
    assert sync_stats(state) == {
        "all_reduce[float32]": od.KindTotals(2 + 3, 2 * 8 * 4 + 3 * 8 * 4),  # 2 warm-up steps, 3 syncs
    }


def test_partial_average_wire_dtype(harness):
    parts = ((1,), (0,))
    _, state = run_trajectory(
        harness,
        lambda c: od.partial_average(optax.sgd(LR), comm=c, partitions=parts, dtype=jnp.bfloat16),
        steps=5,
    )
    stats = sync_stats(state)
    assert stats["all_reduce[partition0:bfloat16]"] == od.KindTotals(3, 3 * 6 * 2)
    assert stats["all_reduce[partition1:bfloat16]"] == od.KindTotals(2, 2 * 2 * 2)


def test_diloco_outer_optimizer_sees_the_parameter_tree(harness):
    """One fragment keeps the parameters' structure: tree-structured outer optimizers work."""
    masked = lambda: optax.masked(optax.sgd(0.7), {"b": False, "w": True})
    labelled = lambda: optax.multi_transform(
        {"outer": optax.sgd(0.7), "plain": optax.identity()}, {"b": "plain", "w": "outer"}
    )
    a, _ = run_trajectory(harness, lambda c: od.diloco(optax.sgd(LR), masked(), comm=c, period=3), steps=9)
    b, _ = run_trajectory(harness, lambda c: od.diloco(optax.sgd(LR), labelled(), comm=c, period=3), steps=9)
    close(a, b, atol=0)


def _recording_outer():
    """An outer sgd(1) that keeps the ``inner_step`` of its last update."""

    def init(params):
        return jnp.asarray(-1, jnp.int32)

    def update(delta, state, params=None, *, inner_step, **extra):
        return jax.tree.map(lambda d: -d, delta), jnp.asarray(inner_step, jnp.int32)

    return optax.GradientTransformationExtraArgs(init, update)


def test_outer_optimizer_gets_the_absolute_step_after_a_warmup(harness):
    _, state = run_trajectory(
        harness,
        lambda c: od.diloco(optax.sgd(LR), _recording_outer(), comm=c, period=3, warmup_steps=2),
        steps=11,
    )
    # syncs after the warm-up of 2 steps: t = 4, 7, 10 (the inner optimizer's own step)
    np.testing.assert_array_equal(state.sync_state.outer_states[0], 10)
