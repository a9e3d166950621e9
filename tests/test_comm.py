"""The communicator's collectives on every harness, hierarchies, and its clear errors."""

import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from tests.problems import init_params
from tests.test_allreduce import LR, run_trajectory


def test_collectives(harness):
    n, comm = harness.n, harness.comm
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    ring = [(i, (i + 1) % n) for i in range(n)]
    chain = [(i, i + 1) for i in range(n - 1)]

    def step(v):
        return {
            "index": comm.index(),
            "psum": comm.psum(v),
            "pmean_bf16": comm.pmean(v, dtype=jnp.bfloat16),
            "gather": comm.all_gather(v),
            "ring": comm.permute(v, ring),
            "chain": comm.permute(v, chain),
            "ring_bf16": comm.permute(
                {"f": v / 3, "i": v.astype(jnp.int32), "b": v > 2}, ring, dtype="bfloat16"
            ),
            "bcast": comm.broadcast(v, n - 1),
            "any": comm.agree(v[0] > 3 * (n - 1) - 0.5, op="any"),
            "all": comm.agree(v[0] > 3 * (n - 1) - 0.5, op="all"),
            "size": jnp.asarray(comm.size),
            "scatter": comm.psum_scatter(jnp.concatenate([v * (j + 1) for j in range(n)])),
        }

    out = harness.run(step, x)
    np.testing.assert_array_equal(out["index"], np.arange(n))
    np.testing.assert_array_equal(out["psum"], np.broadcast_to(x.sum(0), x.shape))
    np.testing.assert_allclose(out["pmean_bf16"], np.broadcast_to(x.mean(0), x.shape), rtol=1e-2)
    np.testing.assert_array_equal(out["gather"], np.broadcast_to(x, (n, n, 3)))
    np.testing.assert_array_equal(out["ring"], np.roll(x, 1, axis=0))
    rounded = np.asarray(jnp.asarray(x / 3).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(out["ring_bf16"]["f"], np.roll(rounded, 1, axis=0))  # back in float32
    assert out["ring_bf16"]["f"].dtype == np.float32
    np.testing.assert_array_equal(out["ring_bf16"]["i"], np.roll(x.astype(np.int32), 1, axis=0))
    np.testing.assert_array_equal(out["ring_bf16"]["b"], np.roll(x > 2, 1, axis=0))
    np.testing.assert_array_equal(out["chain"][0], np.zeros(3))
    np.testing.assert_array_equal(out["chain"][1:], x[:-1])
    np.testing.assert_array_equal(out["bcast"], np.broadcast_to(x[-1], x.shape))
    assert out["any"].all() and not out["all"].any()
    assert (out["size"] == n).all()
    np.testing.assert_array_equal(out["scatter"], np.arange(1, n + 1)[:, None] * x.sum(0))


def test_broadcast_is_bit_exact_with_nonfinite_values_elsewhere(harness):
    n, comm = harness.n, harness.comm
    x = np.full((n, 4), np.nan, np.float32)
    x[0] = [1.0, -0.0, 3.5e-39, 7.0]  # includes a subnormal
    x[1:, 0] = np.inf
    out = harness.run(lambda v: comm.broadcast({"f": v, "b": v > 2}, 0), x)
    np.testing.assert_array_equal(out["f"], np.broadcast_to(x[0], x.shape))
    np.testing.assert_array_equal(out["b"], np.broadcast_to(x[0] > 2, x.shape))


def test_broadcast_from_a_root_that_is_state(harness):
    """A traced root (DASO's sending group, part of its state) sends that member's bits, in one
    program for every root; out of the group it is clamped, as ``lax.switch`` clamps its index."""
    n, comm = harness.n, harness.comm
    x = np.full((n, 4), np.nan, np.float32)
    x[:, 0], x[:, 1], x[-1, 2], x[0, 3] = np.arange(n), -0.0, 3.5e-39, np.inf
    roots = {"last": n - 1, "first": 0, "above": n + 3, "below": -2}
    stacked = {k: np.full(n, r, np.int32) for k, r in roots.items()}

    def step(v, r):
        tree = {"f": v, "bf16": v.astype(jnp.bfloat16), "b": v > 2}
        return {k: comm.broadcast(tree, r[k]) for k in roots}

    out = harness.run(step, x, stacked)
    as_bf16 = np.asarray(jnp.asarray(x).astype(jnp.bfloat16))
    for k, r in roots.items():
        src = min(max(r, 0), n - 1)
        got = out[k]
        np.testing.assert_array_equal(
            got["f"].view(np.uint32), np.broadcast_to(x[src], x.shape).view(np.uint32)
        )
        np.testing.assert_array_equal(
            got["bf16"].view(np.uint16), np.broadcast_to(as_bf16[src], x.shape).view(np.uint16)
        )
        np.testing.assert_array_equal(got["b"], np.broadcast_to(x[src] > 2, x.shape), err_msg=k)
    if isinstance(comm, od.MpiComm):  # its clear error under vmap comes before the roots' branches
        with pytest.raises(RuntimeError, match="inside jax.vmap"):
            jax.vmap(lambda v, r: comm.broadcast(v, r))(jnp.ones(2), jnp.zeros(2, jnp.int32))


def test_replicas_identical_and_broadcast_from_root(harness):
    n, comm = harness.n, harness.comm
    x = np.random.default_rng(0).normal(size=(n, 5)).astype(np.float32)

    def step(v):
        before = od.replicas_identical(v, comm=comm)
        synced = od.broadcast_from_root(v, comm=comm)
        return before, od.replicas_identical(synced, comm=comm), synced

    before, after, synced = harness.run(step, x)
    assert (before == (n == 1)).all() and after.all()
    od.assert_replicas_identical(synced)
    with pytest.raises(AssertionError, match="differ from replica 0"):
        od.assert_replicas_identical({"x": x})


def test_hierarchy_vmap_and_mesh():
    nodes, local = 2, 4
    x = np.arange(nodes * local, dtype=np.float32)

    def step(h):
        def f(v):
            return h.local.psum(v), h.cross.psum(v), h.world.index(), h.cross.index()

        return f

    sim = od.simulate(
        step(od.axis_hierarchy(nodes, local)), axis_name=("node", "local"), shape=(nodes, local)
    )(x)
    h = od.mesh_hierarchy(nodes, local)
    mesh_out = od.on_mesh(step(h), h.mesh)(x)
    want_local = np.repeat(x.reshape(nodes, local).sum(1), local)
    want_cross = np.tile(x.reshape(nodes, local).sum(0), nodes)
    for out in (sim, mesh_out):
        np.testing.assert_array_equal(out[0], want_local)
        np.testing.assert_array_equal(out[1], want_cross)
        np.testing.assert_array_equal(out[2], np.arange(nodes * local))
        np.testing.assert_array_equal(out[3], np.repeat(np.arange(nodes), local))


def test_unbound_axis_is_a_clear_error():
    comm = od.AxisComm("replica")
    with pytest.raises(ValueError, match="axis 'replica' is not bound"):
        jax.jit(lambda v: comm.psum(v))(jnp.ones(3))


def test_group_sizes_must_divide_the_world():
    with pytest.raises(ValueError, match="does not divide"):
        od.mesh_hierarchy(3, 3)
    with pytest.raises(ValueError, match="must equal the number of devices"):
        od.mesh_hierarchy(2, 2)


def test_bad_arguments():
    with pytest.raises(ValueError, match="axis_name"):
        od.AxisComm("")
    comm = od.AxisComm("replica")
    f = lambda perm: jax.vmap(lambda v: comm.permute(v, perm), axis_name="replica")(jnp.ones(2))
    with pytest.raises(ValueError, match="out of range"):
        f([(0, 2)])
    with pytest.raises(ValueError, match="at most once"):
        f([(0, 1), (1, 1)])
    for root in (5, np.int32(-1), jnp.int32(2)):  # ints and concrete arrays are checked
        with pytest.raises(ValueError, match="root="):
            jax.vmap(lambda v, r=root: comm.broadcast(v, r), axis_name="replica")(jnp.ones(2))
    for root in (jnp.float32(1), jnp.zeros(1, jnp.int32)):  # a traced root: an integer scalar
        with pytest.raises(TypeError, match="integer scalar"):
            jax.jit(jax.vmap(lambda v, r: comm.broadcast(v, r), (0, None), axis_name="replica"))(
                jnp.ones(2), root
            )
    with pytest.raises(ValueError, match="op="):
        jax.vmap(lambda v: comm.agree(v > 0, op="most"), axis_name="replica")(jnp.ones(2))


def test_mpi_comm_refuses_multi_device_computations():
    comm = od.MpiComm()  # a world of one process outside mpirun
    with pytest.raises(RuntimeError, match="one device per MPI process"):
        mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
        od.on_mesh(lambda v: comm.psum(v), mesh)(jnp.ones(2))
    with pytest.raises(RuntimeError, match="inside jax.vmap"):
        jax.vmap(lambda v: comm.psum(v))(jnp.ones(2))


def test_mpi_hierarchy_rejects_bad_split():
    with pytest.raises(ValueError, match="local_size"):
        od.mpi_hierarchy(0)
    with pytest.raises(ValueError, match="does not divide"):
        od.mpi_hierarchy(3)  # a world of one process


def test_mpi_hierarchy_under_mpi(harness):
    """Under mpirun with 4 processes: 2 nodes × 2; one process per node: its devices. Elsewhere:
    the same groups with AxisComm."""
    n = harness.n
    if harness.name == "node":
        h = harness.hierarchy
        local = h.local_size
    elif harness.name == "mpi":
        local = 2 if n % 2 == 0 else 1
        h = od.mpi_hierarchy(local)
    else:
        return  # the vmap/mesh hierarchies are covered by test_hierarchy_vmap_and_mesh
    x = np.arange(n, dtype=np.float32)
    out = harness.run(lambda v: (h.local.psum(v), h.cross.psum(v)), x)
    np.testing.assert_array_equal(out[0], np.repeat(x.reshape(-1, local).sum(1), local))
    np.testing.assert_array_equal(out[1], np.tile(x.reshape(-1, local).sum(0), n // local))


def test_pmean_rejects_integer_leaves():
    comm = od.AxisComm("replica")
    with pytest.raises(TypeError, match="floating-point"):
        jax.vmap(lambda v: comm.pmean(v), axis_name="replica")(jnp.ones(2, jnp.int32))


def test_solo_comm_is_a_group_of_one():
    comm = od.SoloComm()
    x = jnp.arange(3.0)
    assert comm.size == 1 and int(comm.index()) == 0
    np.testing.assert_array_equal(comm.pmean(x), x)
    np.testing.assert_array_equal(comm.all_gather(x), x[None])
    np.testing.assert_array_equal(comm.broadcast(x, 0), x)
    np.testing.assert_array_equal(comm.psum_scatter(x), x)
    assert bool(comm.agree(jnp.asarray(True), op="all"))
    tx = od.allreduce(comm=comm)
    u, s = jax.jit(lambda g: tx.update(g, tx.init(g)))(x)
    np.testing.assert_array_equal(u, x)
    assert od.comm_stats(s).bytes == 12


def _run_rounds(rounds, to_myself, x, nodes, local_size):
    """The data movement of NodeComm._permute, in NumPy: what each member ends with."""
    out = np.where(to_myself, x, 0.0)
    for r in rounds:
        arrived = x
        if any(r.cross):
            arrived = np.zeros_like(x)
            for i, pairs in enumerate(r.cross):
                for n, m in pairs:
                    arrived[m * local_size + i] = x[n * local_size + i]
            out = np.where(r.cross_final, arrived, out)
        if r.local:
            sent = np.where(r.forward, arrived, x)
            got = np.zeros_like(x)
            for node in range(nodes):
                for a, b in r.local:
                    got[node * local_size + b] = sent[node * local_size + a]
            out = np.where(r.local_final, got, out)
    return out


@pytest.mark.parametrize("nodes, local_size", [(2, 4), (3, 2), (4, 1), (1, 4), (3, 3)])
def test_node_permutation_routing(nodes, local_size):
    """Every (partial) permutation of the world is delivered by the rounds NodeComm plans: one cross
    hop and one local hop per message, each device sending and receiving once per stage."""
    from optaxdist.comm.node import _route

    world = nodes * local_size
    rng = np.random.default_rng(world)
    x = np.arange(1.0, world + 1)
    ring = [(i, (i + 1) % world) for i in range(world)]
    perms = [ring, [(d, s) for s, d in ring]]
    for _ in range(20):
        dst = rng.permutation(world)
        keep = rng.random(world) < 0.7
        perms.append([(s, int(dst[s])) for s in range(world) if keep[s]])
    for perm in perms:
        rounds = _route(tuple(perm), nodes, local_size)
        to_myself = np.asarray([any(s == d == w for s, d in perm) for w in range(world)])
        want = np.zeros(world)
        for s, d in perm:
            want[d] = x[s]
        np.testing.assert_array_equal(_run_rounds(rounds, to_myself, x, nodes, local_size), want, str(perm))
        for r in rounds:
            for pairs in r.cross:
                assert len({n for n, _ in pairs}) == len(pairs) and len({m for _, m in pairs}) == len(pairs)
    assert len(_route(tuple(ring), nodes, local_size)) == 1  # a ring is one round


def test_node_hierarchy_on_one_node_and_its_errors():
    """One process = one node of 8 devices (the cross-node group has one member); the errors of a
    node hierarchy used outside ``on_node`` and of ``on_node`` given another hierarchy."""
    h = od.node_hierarchy()
    assert (h.num_nodes, h.local_size, h.world.size) == (1, 8, 8)
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    out = od.on_node(lambda v: (h.world.psum(v), h.world.index(), h.world.all_gather(v)), h)(x)
    np.testing.assert_array_equal(np.asarray(out[0]), np.broadcast_to(x.sum(0), x.shape))
    np.testing.assert_array_equal(np.asarray(out[1]), np.arange(8))
    np.testing.assert_array_equal(np.asarray(out[2][3]), x)
    outside = jax.shard_map(
        lambda v: h.world.psum(v), mesh=h.mesh, in_specs=jax.P("local"), out_specs=jax.P()
    )
    with pytest.raises(RuntimeError, match="outside optaxdist.on_node"):
        jax.jit(outside)(x)
    with pytest.raises(TypeError, match="node_hierarchy"):
        od.on_node(lambda v: v, od.mesh_hierarchy(2, 4))


def _node_plans(nodes: int, local_size: int) -> od.NodeComm:
    """A NodeComm for its static plans only (``by_level``): no MPI, nothing is exchanged."""
    return od.NodeComm(od.CrossComm(types.SimpleNamespace(size=nodes), "local", local_size))


def test_node_bytes_per_level():
    """What each member of 2 nodes × 4 hands to each level, against the composition by hand."""
    world, S = _node_plans(2, 4), 4000
    f32 = [(1000, 4)]  # one leaf of 1,000 float32: 250 elements per device after the scatter
    composed = (
        ("local", "reduce_scatter", S),
        ("cross", "all_reduce", S // 4),
        ("local", "all_gather", S // 4),
    )
    assert world.by_level("all_reduce", f32) == composed
    assert world.by_level("broadcast", f32) == composed
    # each leaf is padded to a multiple of 4: 1,001 float32 -> 251 per device, 1 bfloat16 -> 1
    block = 251 * 4 + 1 * 2
    assert world.by_level("all_reduce", [(1001, 4), (1, 2)]) == (
        ("local", "reduce_scatter", 4 * block),
        ("cross", "all_reduce", block),
        ("local", "all_gather", block),
    )
    assert world.by_level("all_gather", f32) == (("cross", "all_gather", S), ("local", "all_gather", 2 * S))
    assert world.by_level("reduce_scatter", f32) == (
        ("local", "reduce_scatter", S),
        ("cross", "reduce_scatter", S // 4),
    )
    cross, local = ("cross", "permute", S), ("local", "permute", S)
    # ring: one round; inside each node i -> i+1, and local index 3 sends across first (3 -> 4 is
    # 3 -> node 1's device 3 -> its device 0; 7 -> 0 alike)
    ring = [(i, (i + 1) % 8) for i in range(8)]
    want = [(local,)] * 3 + [(cross, local)] + [(local,)] * 3 + [(cross, local)]
    assert [world.by_level("permute", f32, perm=ring, member=m) for m in range(8)] == want
    # 0->6, 1->7 and 6->3, 7->0 cross (then move i -> k inside the node), 3->1 stays, 2, 4, 5 keep
    # theirs. Round 1: crossings at local indices 0 and 1 (nodes 0 -> 1), local stage 0->2, 1->3,
    # 3->1. Round 2 (1->3 took local index 3 from 6's hop 2->3): crossings at 2 and 3 (1 -> 0),
    # local stage 2->3, 3->0. A local stage sends from its local indices on every node, with a
    # message to forward or not (members 0, 1 and 7 in round 1, 6 and 7 in round 2 send what
    # nobody keeps).
    perm = [(0, 6), (1, 7), (2, 2), (3, 1), (4, 4), (5, 5), (6, 3), (7, 0)]
    want = [
        (cross, local),  # 0, 1: their messages across, then a local send nobody keeps
        (cross, local),
        (local,),  # 2: forwards 6's message to 3 in round 2
        (local, local),  # 3: its own message to 1, then forwards 7's to 0
        (local,),  # 4, 5: forward 0's and 1's messages
        (local,),
        (cross, local),  # 6: its message across in round 2, and that round's local send
        (local, cross, local),  # 7: local index 3 sends in both local stages
    ]
    assert [world.by_level("permute", f32, perm=perm, member=m) for m in range(8)] == want


def test_node_bytes_per_level_are_what_the_program_hands_over():
    """One node of 8 devices: the per-level ledger of an allreduce step equals what its lowered
    program hands to the local reduce-scatters and all-gathers and to the cross-node callbacks
    (results per device: a reduce-scatter's operand is ``G`` times its result, an all-gather's
    operand ``1/G`` of it, a cross-node all-reduce's operand is its result)."""
    h = od.node_hierarchy()
    G, tx = h.local_size, od.allreduce(comm=h.world)
    grads = {"w": np.ones((G, 3, 2), np.float32), "b": np.ones((G, 2), np.float32)}
    state = od.on_node(tx.init, h)(grads)
    step = od.on_node(lambda g, s: tx.update(g, s), h, check_config=False)
    handed = {}
    for line in step.lower(grads, state).as_text(dialect="hlo").splitlines():
        op = re.search(r"= (\w+)\[([\d,]*)\]\S* (reduce-scatter|all-gather|custom-call)\(", line)
        if op is None or (op[3] == "custom-call" and "python_cpu_callback" not in line):
            continue
        result = math.prod(int(d) for d in op[2].split(",") if d) * {"f32": 4}[op[1]]
        level, per_result = {
            "reduce-scatter": ("local:reduce_scatter", G),
            "all-gather": ("local:all_gather", 1 / G),
        }.get(op[3], ("cross:all_reduce", 1))
        handed[level] = handed.get(level, 0) + result * per_result
    stats = od.comm_stats(step(grads, state)[1], levels=h.world).by_kind
    assert handed == {
        "local:reduce_scatter": stats["local:all_reduce/reduce_scatter[float32]"].bytes,
        "cross:all_reduce": stats["cross:all_reduce[float32]"].bytes,
        "local:all_gather": stats["local:all_reduce/all_gather[float32]"].bytes,
    }


def test_hierarchical_local_sgd_bytes_per_level(harness):
    """One process per node: the world averages of a two-level local SGD split into node-local and
    cross-node bytes as ``NodeComm`` sends them; the node averages stay local. Elsewhere a no-op
    (the split is checked above, the transform in test_local_sgd)."""
    if harness.name != "node":
        return
    h, steps = harness.hierarchy, 8
    params, state = run_trajectory(
        harness,
        lambda c: od.local_sgd(optax.sgd(LR), comm=c, period=4, local_comm=h.local, local_period=2),
        steps=steps,
    )
    for x in params.values():  # step 8 averages over the world (optax.apply_updates: up to rounding)
        np.testing.assert_allclose(x, np.broadcast_to(x[0], x.shape), atol=1e-6)
    G, world_syncs, node_syncs = h.local_size, steps // 4, steps // 4
    block = 4 * sum(-(-v.size // G) for v in init_params().values())  # leaves padded to G
    check = 4 * 2  # the start check: 2 uint32 fingerprints (one per leaf) and an int32 vote
    assert od.comm_stats(state, levels=h.world).by_kind == {
        "local:param_average/reduce_scatter[float32]": od.KindTotals(world_syncs, world_syncs * G * block),
        "cross:param_average[float32]": od.KindTotals(world_syncs, world_syncs * block),
        "local:param_average/all_gather[float32]": od.KindTotals(world_syncs, world_syncs * block),
        "local:param_average[float32]": od.KindTotals(node_syncs, node_syncs * 4 * 8),
        "local:broadcast/reduce_scatter[start check]": od.KindTotals(1, G * check),
        "cross:broadcast/all_reduce[start check]": od.KindTotals(1, check),
        "local:broadcast/all_gather[start check]": od.KindTotals(1, check),
    }


def test_one_level_groups_and_by_level_arguments():
    comm = od.AxisComm("replica")
    assert comm.by_level("all_reduce", [(3, 4), (2, 2)]) == (("world", "all_reduce", 16),)
    assert od.SoloComm().by_level("permute", [(3, 4)], perm=[(0, 0)], member=0) == ()
    world = _node_plans(2, 4)
    with pytest.raises(ValueError, match="collective="):
        world.by_level("gather", [(3, 4)])
    with pytest.raises(ValueError, match="perm= and member="):
        world.by_level("permute", [(3, 4)], perm=[(0, 1)])
    with pytest.raises(ValueError, match="perm= and member="):
        world.by_level("all_reduce", [(3, 4)], perm=[(0, 1)], member=0)
    with pytest.raises(ValueError, match="member=8 is out of range"):
        world.by_level("permute", [(3, 4)], perm=[(0, 1)], member=8)


def test_comm_stats_per_level():
    """A ledger read per level: world events split by the NodeComm, the others as recorded."""
    from optaxdist.accounting import CommLedger, Kind, payload_bytes

    grads = {"w": jax.ShapeDtypeStruct((3, 2), jnp.float32), "b": jax.ShapeDtypeStruct((2,), jnp.float32)}
    average, gossip = Kind("all_reduce", "float32", label="param_average"), Kind("permute", "params")
    node_average = Kind("all_reduce", "float32", scope="local")
    agree = Kind("all_reduce", "int32", label="agree")
    ledger = CommLedger.create(
        {average: payload_bytes(grads), gossip: payload_bytes(grads), node_average: 32, agree: 4}
    )
    for kind, times in ((average, 3), (gossip, 5), (node_average, 2), (agree, 1)):
        ledger = ledger.record(kind, times)
    stats = od.comm_stats(ledger, levels=_node_plans(2, 4))
    block = 4 * (2 + 1)  # w: 6 elements -> 2 per device, b: 2 -> 1 (padded to multiples of 4)
    assert stats.by_kind == {
        "local:param_average/reduce_scatter[float32]": od.KindTotals(3, 3 * 4 * block),
        "cross:param_average[float32]": od.KindTotals(3, 3 * block),
        "local:param_average/all_gather[float32]": od.KindTotals(3, 3 * block),
        "permute[params]": od.KindTotals(5, 5 * 32),
        "local:all_reduce[float32]": od.KindTotals(2, 2 * 32),
        "local:agree/reduce_scatter[int32]": od.KindTotals(1, 16),  # one int32, padded to 4
        "cross:agree[int32]": od.KindTotals(1, 4),
        "local:agree/all_gather[int32]": od.KindTotals(1, 4),
    }
    assert stats.by_scope == {
        "local": od.KindTotals(3 + 3 + 2 + 1 + 1, 3 * 5 * block + 2 * 32 + 20),
        "cross": od.KindTotals(4, 3 * block + 4),
        "world": od.KindTotals(5, 5 * 32),
    }
    assert od.comm_stats(ledger, levels=od.AxisComm("replica")) == od.comm_stats(ledger)
    assert od.comm_stats(ledger).by_scope["world"] == od.KindTotals(9, 3 * 32 + 5 * 32 + 4)


def test_axis_hierarchy_checks_its_sizes():
    for bad in (0, -1, 2.5, "2", True):
        with pytest.raises(ValueError, match=rf"num_nodes={bad!r} must be an int ≥ 1"):
            od.axis_hierarchy(bad, 4)
        with pytest.raises(ValueError, match=rf"local_size={bad!r} must be an int ≥ 1"):
            od.axis_hierarchy(2, bad)
    assert od.axis_hierarchy(np.int64(2), 4).num_nodes == 2


def test_small_leaves_are_permuted_together_on_a_mesh():
    """On a mesh ``permute`` sends the leaves under ``PACK_LEAF_BYTES`` as one buffer per wire
    dtype (one collective each: a CPU mesh's collective costs a rendezvous of every device's
    thread), a larger leaf alone; what arrives is bit for bit what leaf-by-leaf sends give,
    whatever the leaves hold (NaN, -0, subnormals), and bfloat16 travels as 16 bits."""
    from optaxdist.comm import base

    n = 8
    mesh = jax.make_mesh((n,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    comm, ring = od.AxisComm("replica"), [(i, (i + 1) % n) for i in range(n)]
    big = base.PACK_LEAF_BYTES // 4  # float32 elements of a leaf that goes alone
    rng = np.random.default_rng(0)
    specials = np.array([np.nan, -0.0, np.inf, 1e-40, -1e-40], np.float32)
    tree = {
        "w": rng.normal(size=(n, 3, 5)).astype(np.float32),
        "b": np.concatenate([specials, rng.normal(size=3).astype(np.float32)])[None].repeat(n, 0),
        "h": rng.normal(size=(n, 4)).astype(jnp.bfloat16),
        "k": rng.integers(-9, 9, size=(n, 2)).astype(np.int32),
        "k2": rng.integers(-9, 9, size=(n, 2)).astype(np.int32),
        "m": rng.random((n, 3)) < 0.5,
        "m2": rng.random((n, 1)) < 0.5,
        "e": np.zeros((n, 0), np.float32),
        "big": rng.normal(size=(n, big)).astype(np.float32),
        "s": rng.normal(size=(n,)).astype(np.float32),
    }

    def leaf_by_leaf(t):
        return jax.tree.map(lambda x: jax.lax.ppermute(x, "replica", ring), t)

    packed = od.on_mesh(lambda t: comm.permute(t, ring), mesh)
    wanted = od.on_mesh(leaf_by_leaf, mesh)(tree)
    got = packed(tree)
    for name in tree:
        assert np.asarray(got[name]).dtype == tree[name].dtype
        assert np.asarray(got[name]).tobytes() == np.asarray(wanted[name]).tobytes(), name
    hlo = packed.lower(tree).compile().as_text()
    sent = sorted(re.findall(r"= (\S+) collective-permute\(", hlo))
    # one buffer per dtype: w, b, e and s; k and k2; m and m2; h alone (its bits); big alone
    assert sent == sorted([f"f32[{big}]{{0}}", "f32[24]{0}", "s32[4]{0}", "pred[4]{0}", "u16[4]{0}"])
    # under vmap nothing crosses devices: each leaf is indexed on its own, nothing is packed
    on_one_device = od.simulate(lambda t: comm.permute(t, ring))
    assert "concatenate" not in str(jax.make_jaxpr(on_one_device)(tree))
    simulated = on_one_device(tree)
    for name in tree:
        assert np.asarray(simulated[name]).tobytes() == np.asarray(wanted[name]).tobytes(), name


def test_permute_buckets_small_leaves_per_dtype_in_order():
    """``_buckets``: small leaves of one dtype share a bucket up to ``PACK_BUCKET_BYTES``; a leaf
    of ``PACK_LEAF_BYTES`` or more goes alone."""
    from optaxdist.comm import base

    f32, bf16 = jnp.float32, jnp.bfloat16
    small, large = base.PACK_LEAF_BYTES // 4 - 1, base.PACK_LEAF_BYTES // 4
    shapes = [(small, f32), (3, bf16), (large, f32), (small, f32), (5, bf16)]
    leaves = [jax.ShapeDtypeStruct((k,), dt) for k, dt in shapes]
    assert base._buckets(leaves) == [[0, 3], [1, 4], [2]]
    per_bucket = base.PACK_BUCKET_BYTES // (4 * small)  # whole small leaves that fit one bucket
    many = [jax.ShapeDtypeStruct((small,), f32)] * (per_bucket + 1)
    assert base._buckets(many) == [list(range(per_bucket)), [per_bucket]]
