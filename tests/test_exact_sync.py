"""After a synchronization every replica holds the same bits (``exact_sync`` + ``apply_updates``).

Every transform that replaces the parameters by an agreed value, in float32, bfloat16 and float16,
under every harness: after each update whose synchronization set a leaf (``agreed.fresh``), that
leaf's bits are identical on every replica of the synchronization's group (all replicas, or the
node for a node-level average and DASO's merge broadcast).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist.bench.data import random_normal
from optaxdist.transforms.periodic import AGREED
from tests.harness import VmapHarness

STEPS = 8
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
INNER = optax.sgd(0.1, momentum=0.9)


def params0(dtype):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {
        "w": (0.1 * random_normal(k1, (16, 8))).astype(dtype),
        "b": (0.01 * jax.random.normal(k2, (8,))).astype(dtype),
    }


def hierarchy(harness):
    """``(h, N, G, run)``: a node hierarchy on this harness and a runner of stacked inputs."""
    if harness.name == "node":
        h = harness.hierarchy
        return h, h.num_nodes, h.local_size, harness.run
    if harness.name == "mpi":
        G = 2 if harness.n % 2 == 0 and harness.n >= 4 else 1
        h = od.mpi_hierarchy(G)
        return h, harness.n // G, G, harness.run
    N, G = harness.n // 2, 2
    if harness.name == "vmap":
        h = od.axis_hierarchy(N, G)

        def run(step, *stacked):
            out = od.simulate(step, axis_name=("node", "local"), shape=(N, G))(*stacked)
            return jax.tree.map(np.asarray, out)

        return h, N, G, run
    mh = od.mesh_hierarchy(N, G, devices=jax.devices()[: N * G])
    return mh, N, G, lambda step, *stacked: jax.tree.map(np.asarray, od.on_mesh(step, mh.mesh)(*stacked))


def node_scope(state) -> jax.Array:
    """True when the last update's synchronization agreed within the node only."""
    if isinstance(state, od.DasoState):
        return state.last_events.averaged_group < 0
    return state.last_sync == 1  # local_sgd's node-level average


CASES = {
    "local_sgd": lambda h: od.local_sgd(INNER, comm=h.world, period=2),
    "local_sgd_hierarchical": lambda h: od.local_sgd(
        INNER, comm=h.world, local_comm=h.local, period=4, local_period=2
    ),
    "average_params": lambda h: optax.chain(INNER, od.average_params(comm=h.world)),
    "diloco": lambda h: od.diloco(INNER, comm=h.world, period=2),
    "diloco_sharded": lambda h: od.diloco(INNER, comm=h.world, period=2, num_shards=h.world.size),
    "slowmo": lambda h: od.slowmo(INNER, comm=h.world, period=3, learning_rate=0.1),
    "streaming_diloco": lambda h: od.streaming_diloco(
        INNER, comm=h.world, period=4, num_fragments=2, delay=1
    ),
    "partial_average": lambda h: od.partial_average(INNER, comm=h.world, partitions=[[0], [1]]),
    "decentralized_sgd": lambda h: od.decentralized_sgd(
        INNER, comm=h.world, topology=od.topology.ring(h.world.size), average_period=3
    ),
    "sgp": lambda h: od.sgp(
        INNER, comm=h.world, topology=od.topology.exponential(h.world.size), average_period=3
    ),
    "daso": lambda h: od.daso(
        INNER,
        local_comm=h.local,
        cross_comm=h.cross,
        steps_per_epoch=4,
        total_epochs=2,
        warmup_epochs=0,
        cooldown_epochs=0,
        first_cycle=(2, 1, 1),
    ),
}


def engine_state(opt_state):
    (state,) = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, (od.PeriodicState, od.DasoState)))
        if isinstance(s, (od.PeriodicState, od.DasoState))
    ]
    return state


def run_case(harness, make, dtypes=DTYPES, apply=od.apply_updates):
    """Per dtype: the parameters' bits after every update, the fresh flags and the scope."""
    h, N, G, run = hierarchy(harness)

    def train(c, *ps):
        tx = make(h)
        out = []
        for p in ps:

            def step(carry, t):
                p, state = carry  # different gradients on every replica (threefry compiles slowly)
                grads = jax.tree.map(
                    lambda x: jnp.sin(x * c[0].astype(x.dtype) + (t * c[1]).astype(x.dtype)), p
                )
                updates, state = tx.update(grads, state, p, value=jnp.float32(1.0))
                plain = optax.apply_updates(p, updates)
                p = apply(p, updates, state)
                s = engine_state(state)
                return (p, state), (p, plain, s.agreed.fresh, node_scope(s))

            out.append(jax.lax.scan(step, (p, tx.init(p)), jnp.arange(STEPS, dtype=jnp.float32))[1])
        return out

    W = N * G
    c = np.stack([np.linspace(1, 3, W), np.linspace(0.5, 2, W)], 1).astype(np.float32)
    stacked = [od.replicate(params0(d), W) for d in dtypes]
    return run(train, c, *stacked), N, G


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


def assert_agreed_bits(traces, N, G, dtypes=DTYPES, min_syncs=1):
    """Every agreed leaf identical on its group after every step, and within a rounding of what
    ``optax.apply_updates`` gives; every other leaf exactly what it gives. ``min_syncs`` agreed
    steps per leaf at least."""
    for dtype, trace in zip(dtypes, traces):
        synced = {"w": 0, "b": 0}
        params, plain, fresh, node = trace  # leading axes: replica, step
        eps = float(jnp.finfo(dtype).eps)
        for t in range(STEPS):
            for name in params:
                flags = fresh[name][:, t]
                assert (flags == flags[0]).all(), (dtype, t, name)  # the flags are replicated
                got, added = params[name][:, t], plain[name][:, t]
                if flags[0] != AGREED:
                    np.testing.assert_array_equal(bits(got), bits(added), err_msg=f"{dtype} step {t} {name}")
                    continue
                synced[name] += 1
                got32, added32 = np.asarray(got, np.float32), np.asarray(added, np.float32)
                assert np.abs(got32 - added32).max() <= 8 * eps * np.abs(added32).max(), (dtype, t, name)
                p = bits(got)
                groups = p.reshape(N, G, -1) if node[0, t] else p.reshape(1, N * G, -1)
                for g in groups:
                    np.testing.assert_array_equal(
                        g, g[:1].repeat(len(g), 0), err_msg=f"{dtype} step {t} {name}"
                    )
        assert min(synced.values()) >= min_syncs, (dtype, synced)


# the default run keeps one case of each mechanism: anchors kept by the synchronizations' state
# (Streaming DiLoCo: fragments, delayed merges) and DASO's own state; the engine's copy runs by
# default in test_sync_params_under_optax_masked and test_sync_params_with_flax_nnx.
# `scripts/test.sh --all` runs every case (under mpirun -n 4 as well). By default they run on the
# mesh and one process per node (tests/test_mpi.py), where each replica's program is its own; vmap's
# one program for all replicas in the full run.
DEFAULT_CASES = ("streaming_diloco", "daso")


@pytest.mark.sample(harnesses=("vmap",))
@pytest.mark.parametrize(
    "case", [c if c in DEFAULT_CASES else pytest.param(c, marks=pytest.mark.slow) for c in CASES]
)
def test_replicas_hold_the_agreed_bits(harness, case):
    traces, N, G = run_case(harness, CASES[case])
    assert_agreed_bits(traces, N, G)


def test_without_sync_params_replicas_differ_after_a_sync(harness):
    """The property above fails without the mechanism: ``optax.apply_updates`` adds ``target −
    params`` and lands within a rounding of the target, differently on each replica."""
    traces, N, G = run_case(
        harness, CASES["local_sgd"], (jnp.float32,), lambda p, u, s: optax.apply_updates(p, u)
    )
    params, _, fresh, _ = traces[0]
    synced = fresh["w"][0] == AGREED
    assert synced.sum() == STEPS // 2
    w = bits(params["w"][:, synced])
    assert (w != w[:1]).any()


def test_sync_params_with_flax_nnx():
    """``nnx.Optimizer`` wraps the state's leaves (``OptVariable``): sync_params goes leaf by leaf."""
    from flax import nnx

    comm = od.AxisComm(od.REPLICA_AXIS)
    model = nnx.Linear(8, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, od.local_sgd(INNER, comm=comm, period=2), wrt=nnx.Param)
    graphdef, state = od.nnx_replicate((model, optimizer), 4)

    def train(objects, x, y, exact):
        model, optimizer = objects
        grads = nnx.grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        if exact:
            nnx.update(model, od.sync_params(nnx.state(model, nnx.Param), optimizer.opt_state))

    x = random_normal(jax.random.key(1), (4, 16, 8))
    y = jnp.sin(3 * x[..., :4])
    for exact in (False, True):
        step = od.simulate(od.nnx_step(graphdef, lambda o, x, y, e=exact: train(o, x, y, e)))
        s = state
        for _ in range(4):  # steps 2 and 4 average
            s, _ = step(s, x, y)
        kernel = bits(od.nnx_replica(graphdef, s, None)[0].kernel[...])
        assert (kernel == kernel[:1]).all() == exact


def test_sync_params_names_a_shape_mismatch():
    tx = od.local_sgd(INNER, comm=od.SoloComm(), period=1)
    state = tx.init({"w": jnp.zeros((3,))})
    with pytest.raises(ValueError, match=r"made for parameters of shapes \[\(3,\)\], got \[\(4,\)\]"):
        od.sync_params({"w": jnp.zeros((4,))}, state)


def test_what_exact_sync_keeps():
    """A copy of the parameters where nothing else holds them; DiLoCo's anchors are them (flags
    only, unless sharded); ``exact_sync=False`` keeps nothing."""
    comm, p = od.SoloComm(), params0(jnp.bfloat16)
    copy = od.local_sgd(INNER, comm=comm, period=2).init(p).agreed
    assert jax.tree.map(lambda v: v.dtype, copy.values) == jax.tree.map(lambda v: v.dtype, p)
    assert od.diloco(INNER, comm=comm, period=2).init(p).agreed.values is None
    assert od.diloco(INNER, comm=comm, period=2, num_shards=1).init(p).agreed.values is not None
    assert od.local_sgd(INNER, comm=comm, period=2, exact_sync=False).init(p).agreed == ()
    # DASO keeps the bit patterns its in-node broadcast sums (that result, not a copy of it)
    h = od.axis_hierarchy(1, 1)
    daso = od.daso(INNER, local_comm=h.local, cross_comm=h.cross, steps_per_epoch=4, total_epochs=2)
    kept = daso.init(p).agreed.values
    assert jax.tree.map(lambda v: v.dtype, kept) == jax.tree.map(lambda _: jnp.dtype(jnp.int16), p)
    for k, w in zip(jax.tree.leaves(kept), jax.tree.leaves(p)):
        np.testing.assert_array_equal(np.asarray(k).view(np.uint16), bits(w))
    # synchronizations that never agree keep flags only
    assert od.outer_sync(INNER, comm=comm, period=2, blend=0.5, num_shards=1).init(p).agreed.values == ()
    replicas, ring = od.AxisComm(od.REPLICA_AXIS), od.topology.ring(4)

    def gossip_values(**kw):
        init = od.sgp(INNER, comm=replicas, topology=ring, **kw).init
        return jax.vmap(init, axis_name=od.REPLICA_AXIS)(od.replicate(p, 4)).agreed.values

    assert gossip_values() == ()
    assert gossip_values(average_period=2) is not None
    with pytest.raises(ValueError, match="exact_sync='yes' must be a bool"):
        od.partial_average(INNER, comm=comm, exact_sync="yes")


def test_an_integer_leaf_is_agreed_as_a_number():
    """SGP averages an integer leaf in float32 and keeps the copy in the leaf's dtype: the mean,
    cast, not its bit patterns (only DASO keeps bits, of float leaves)."""
    comm, W = od.AxisComm(od.REPLICA_AXIS), 4
    inner = optax.stateless(lambda u, p: jax.tree.map(lambda x, q: (-0.1 * x).astype(q.dtype), u, p))
    tx = od.sgp(inner, comm=comm, topology=od.topology.exponential(W), average_period=2)

    def two_steps(p):
        s = tx.init(p)
        for _ in range(2):  # the second averages
            rank = jax.lax.axis_index(od.REPLICA_AXIS).astype(jnp.float32)
            g = {"w": jnp.ones_like(p["w"]) * (1 + rank), "n": jnp.zeros(2)}
            u, s = tx.update(g, s, p)
            p = od.apply_updates(p, u, s)
        return p, s.agreed

    p0 = od.replicate({"w": jnp.arange(3.0), "n": jnp.array([5, 7], jnp.int32)}, W)
    p0["n"] = p0["n"] + np.arange(W, dtype=np.int32)[:, None]  # means 6.5 and 8.5
    p, agreed = od.simulate(two_steps)(p0)
    assert (np.asarray(agreed.fresh["n"]) == AGREED).all()
    np.testing.assert_array_equal(np.asarray(p["n"]), np.tile([6, 8], (W, 1)))


def test_changed_leaves_are_not_overwritten():
    """A blended merge and a gossip round change the parameters without agreeing: flags CHANGED,
    and ``apply_updates`` is ``optax.apply_updates``. Nested in such an outer transform, an inner
    average that agreed on the same step does not overwrite the outer's values."""
    h = VmapHarness(4)
    cases = {
        "blend": (lambda h: od.outer_sync(INNER, comm=h.world, period=2, blend=0.5), (0, 2) * 4),
        "gossip": (
            lambda h: od.decentralized_sgd(INNER, comm=h.world, topology=od.topology.ring(h.world.size)),
            (2,) * 8,
        ),
        "nested": (
            lambda h: od.outer_sync(
                od.local_sgd(INNER, comm=h.world, period=2), comm=h.world, period=2, blend=0.5
            ),
            (0, 2) * 4,
        ),
    }
    for name, (make, schedule) in cases.items():
        traces, N, G = run_case(h, make, (jnp.float32,))
        assert_agreed_bits(traces, N, G, (jnp.float32,), min_syncs=0)  # outermost flags: no AGREED
        assert tuple(traces[0][2]["w"][0]) == schedule, name


def test_sync_params_under_optax_masked():
    """A state inside ``optax.masked`` covers its own leaves; the others are left alone."""
    h = VmapHarness(4)
    make = lambda h: optax.masked(od.local_sgd(INNER, comm=h.world, period=2), {"w": True, "b": False})  # noqa: E731
    traces, N, G = run_case(h, make, (jnp.float32,))
    params, plain, fresh, _ = traces[0]
    assert isinstance(fresh["b"], optax.MaskedNode)
    w = bits(params["w"][:, 1])  # step 2 averaged w
    assert (w == w[:1]).all()
    np.testing.assert_array_equal(bits(params["b"]), bits(plain["b"]))
