"""The contract every public transform keeps (DESIGN.md §6)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od

COMM = od.AxisComm("replica")
N = 2

# name -> (factory of a transform, kwargs that must be rejected at construction)
TRANSFORMS = {
    "allreduce": (lambda **kw: od.allreduce(comm=COMM, **kw), dict(op="median")),
    "allreduce_bf16_sum": (
        lambda **kw: od.allreduce(comm=COMM, op="sum", dtype="bfloat16", divide_before=True, **kw),
        dict(dtype="int4"),
    ),
    "allreduce_fp16_clip": (
        lambda **kw: od.allreduce(comm=COMM, dtype="float16", clip_value=10.0, **kw),
        dict(clip_value=0.0),
    ),
    "average_params": (lambda **kw: od.average_params(comm=COMM, **kw), dict(dtype="float64")),
    "dynamic_loss_scale": (
        lambda **kw: od.dynamic_loss_scale(
            optax.chain(od.allreduce(comm=COMM), optax.sgd(0.1)), comm=COMM, **kw
        ),
        dict(growth_interval=-3),
    ),
    "mlbench_loss_scale": (
        lambda **kw: od.mlbench_loss_scale(optax.sgd(0.1), comm=COMM, **kw),
        dict(min_scale=-1.0),
    ),
    "dynamic_loss_scale_backoff": (
        lambda **kw: od.dynamic_loss_scale(optax.sgd(0.1), comm=COMM, **kw),
        dict(backoff_factor=0.0),
    ),
    "skip_nonfinite": (lambda **kw: od.skip_nonfinite(optax.sgd(0.1), comm=COMM, **kw), None),
    "compressed_top_k": (
        lambda **kw: od.compressed_allreduce(od.compress.top_k(fraction=0.5), comm=COMM, **kw),
        dict(scope="block"),
    ),
    "compressed_sign_model": (
        lambda **kw: od.compressed_allreduce(od.compress.sign(scaled=True), comm=COMM, scope="model", **kw),
        dict(residual_dtype=jnp.int8),
    ),
    "compressed_random_k_no_ef": (
        lambda **kw: od.compressed_allreduce(
            od.compress.random_k(count=2), comm=COMM, error_feedback=False, **kw
        ),
        None,
    ),
    "exact_warmup": (
        lambda **kw: od.exact_warmup(
            od.compressed_allreduce(od.compress.cast("float16"), comm=COMM),
            comm=COMM,
            **({"warmup_steps": 1} | kw),
        ),
        dict(warmup_steps=-2),
    ),
    "powersgd": (
        lambda **kw: od.powersgd(comm=COMM, **({"rank": 1, "warmup_steps": 1} | kw)),
        dict(rank=0),
    ),
    "local_sgd": (
        lambda **kw: od.local_sgd(
            optax.sgd(0.1, momentum=0.9),
            comm=COMM,
            **({"period": 1, "warmup_steps": 1, "average_inner_state": True} | kw),
        ),
        dict(period=0),
    ),
    "des_loc": (
        lambda **kw: od.des_loc(
            optax.sgd(0.1, momentum=0.9),
            comm=COMM,
            **({"period": 1, "state_periods": {"trace": 2}, "warmup_steps": 1} | kw),
        ),
        dict(state_periods={"trace": 0}),
    ),
    "diloco": (lambda **kw: od.diloco(optax.sgd(0.1), comm=COMM, **({"period": 1} | kw)), dict(period=-1)),
    "sparseloco": (
        lambda **kw: od.sparseloco(
            optax.sgd(0.1), comm=COMM, **({"period": 1, "chunk_size": 8, "k": 4} | kw)
        ),
        dict(value_bits=3),
    ),
    "slowmo_memory_efficient": (
        lambda **kw: od.slowmo(
            optax.sgd(0.1),
            comm=COMM,
            learning_rate=0.1,
            **({"period": 1, "num_shards": N, "anchor_after_first_step": True} | kw),
        ),
        dict(slow_lr=0.0),
    ),
    "partial_average": (lambda **kw: od.partial_average(optax.sgd(0.1), comm=COMM, **kw), None),
    "streaming_diloco": (
        lambda **kw: od.streaming_diloco(
            optax.sgd(0.1), comm=COMM, **({"period": 2, "num_fragments": 2} | kw)
        ),
        dict(num_fragments=3),
    ),
    "streaming_diloco_overlap": (
        lambda **kw: od.streaming_diloco(
            optax.sgd(0.1),
            comm=COMM,
            **({"period": 4, "num_fragments": 2, "delay": 1, "blend": 0.5, "overlap": True} | kw),
        ),
        dict(delay=0),
    ),
    "decentralized_sgd": (
        lambda **kw: od.decentralized_sgd(
            optax.sgd(0.1, momentum=0.9), comm=COMM, **({"topology": od.topology.ring(N)} | kw)
        ),
        dict(average_period=0),
    ),
    "sgp_overlap": (
        lambda **kw: od.sgp(
            optax.sgd(0.1),
            comm=COMM,
            **({"topology": od.topology.ring(N, directed=True), "overlap": True, "average_period": 2} | kw),
        ),
        dict(average_period=0),
    ),
    "daso": (
        lambda **kw: od.daso(
            optax.sgd(0.1, momentum=0.9),
            local_comm=COMM,
            cross_comm=COMM,
            **({"steps_per_epoch": 2, "total_epochs": 3, "warmup_epochs": 1, "cooldown_epochs": 0} | kw),
        ),
        dict(steps_per_epoch=0),
    ),
    "daso_heat": (
        lambda **kw: od.daso(
            optax.sgd(0.1),
            local_comm=COMM,
            cross_comm=COMM,
            **(
                {
                    "steps_per_epoch": 1,
                    "total_epochs": 3,
                    "warmup_epochs": 0,
                    "cooldown_epochs": 0,
                    "downcast": None,
                    "heat_quirks": od.HeatQuirks.all(),
                }
                | kw
            ),
        ),
        dict(first_cycle=(0, 1, 1)),
    ),
    "sign_sgd": (lambda **kw: od.sign_sgd(0.1, momentum=0.9, **kw), dict(weight_decay=-1.0)),
    "demo": (
        lambda **kw: od.demo(0.1, comm=COMM, **({"chunk_size": 2, "k": 2, "weight_decay": 0.01} | kw)),
        dict(momentum_decay=1.0),
    ),
    "averaged_iterate": (lambda **kw: od.averaged_iterate(**({"shift": 3.0} | kw)), dict(shift=0.0)),
    "singa_sgd": (
        lambda **kw: od.singa_sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=1e-3, **kw),
        dict(momentum=-0.5),
    ),
}


def make_params(dtype=jnp.float32):
    return {"w": jnp.ones((3, 2), dtype), "b": jnp.zeros((2,), dtype), "s": jnp.ones((), dtype)}


def stacked(tree):
    return od.replicate(tree, N)


@pytest.fixture(params=sorted(TRANSFORMS))
def factory(request):
    return TRANSFORMS[request.param][0]


def test_composes_in_chain_and_jit_does_not_recompile(factory):
    """In a chain, three jitted steps, each fed the state the one before returned, trace once: the
    state keeps its structure, shapes, dtypes and weak types from ``init`` on."""
    tx = optax.chain(optax.clip_by_global_norm(1.0), factory(), optax.scale(1.0))
    traces = []

    def step(p, s):
        traces.append(1)
        u, s = tx.update(jax.tree.map(jnp.ones_like, p), s, p)
        return optax.apply_updates(p, u), s

    run = od.simulate(step)
    p = stacked(make_params())
    s = jax.vmap(tx.init)(p)
    p, s = run(p, s)
    p, s = run(p, s)
    p, s = run(p, s)
    assert len(traces) == 1
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(p))


def test_init_on_abstract_shapes(factory):
    tx = factory()
    p = make_params()
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p)
    abstract_state = jax.eval_shape(tx.init, abstract)
    state = tx.init(p)
    shapes = lambda t: [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(t)]
    assert jax.tree.structure(abstract_state) == jax.tree.structure(state)
    assert shapes(abstract_state) == shapes(state)


def test_bf16_params_keep_their_dtype_and_unknown_extra_args_are_ignored(factory):
    """bfloat16 parameters get bfloat16 updates; keyword arguments a transform does not take (a
    loss ``value``, a future argument) change nothing. The state is made inside the program."""
    tx = factory()

    def step(q):
        g = jax.tree.map(jnp.ones_like, q)
        u, _ = tx.update(g, tx.init(q), q)
        extra, _ = tx.update(g, tx.init(q), q, value=jnp.float32(3.0), some_future_arg="x")
        return optax.apply_updates(q, u), u, extra

    new_params, updates, with_extra = od.simulate(step)(stacked(make_params(jnp.bfloat16)))
    for leaf in jax.tree.leaves((new_params, updates)):
        assert leaf.dtype == jnp.bfloat16
    for x, y in zip(jax.tree.leaves(updates), jax.tree.leaves(with_extra), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(n for n, (_, bad) in TRANSFORMS.items() if bad))
def test_bad_hyperparameters_fail_at_construction(name):
    factory, bad = TRANSFORMS[name]
    with pytest.raises((ValueError, TypeError)) as info:
        factory(**bad)
    assert any(key in str(info.value) for key in bad)


def test_state_does_not_alias_the_params(factory):
    """Users donate params and state to one jitted step: no state leaf may be a params leaf."""
    tx = factory()
    p = make_params()
    state = tx.init(p)
    ids = {id(x) for x in jax.tree.leaves(p)}
    assert not [x for x in jax.tree.leaves(state) if id(x) in ids]


# the default run keeps one of each family under pmap; the full run, every transform
PMAP_DEFAULT = ("local_sgd", "powersgd", "sgp_overlap")


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n in PMAP_DEFAULT else pytest.mark.slow) for n in sorted(TRANSFORMS)]
)
def test_pmap_gives_the_numbers_of_simulate(name):
    """``jax.pmap(step, axis_name='replica')`` with an ``AxisComm``: the same numbers as
    ``simulate`` (pmap is deprecated in favour of shard_map, but works and is supported)."""
    tx = TRANSFORMS[name][0]()

    def step(p):
        me = jax.lax.axis_index("replica").astype(jnp.float32)
        s = tx.init(p)
        for t in range(3):
            g = jax.tree.map(lambda x, t=t: jnp.sin(x + me + t).astype(x.dtype), p)
            u, s = tx.update(g, s, p)
            p = optax.apply_updates(p, u)
        return p, s

    p = stacked(make_params())
    want = od.simulate(step)(p)
    got = jax.pmap(step, axis_name="replica", devices=jax.devices()[:N])(p)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-6)


# the default run keeps the periodic engine and PowerSGD donated; the full run, every transform
DONATE_DEFAULT = ("diloco", "powersgd", "streaming_diloco_overlap")
# under simulate, one of them by default: there the buffers are donated to one vmapped program,
# whatever the transform; the mesh keeps the three
DONATE_SIMULATE = ("powersgd",)


@pytest.mark.parametrize(
    "name, where",
    [
        pytest.param(
            n,
            where,
            marks=()
            if n in (DONATE_SIMULATE if where == "simulate" else DONATE_DEFAULT)
            else pytest.mark.slow,
            id=f"{n}-{where}",
        )
        for n in sorted(TRANSFORMS)
        for where in ("simulate", "mesh")
    ],
)
def test_donating_params_and_state_changes_no_number(name, where):
    """A training loop that donates parameters and state (``donate_argnums=(0, 1)``, the buffers
    reused for the results) gets the bits of the same loop without donation."""
    tx = TRANSFORMS[name][0]()

    def step(p, s, t):
        me = jax.lax.axis_index("replica").astype(jnp.float32)
        g = jax.tree.map(lambda x: jnp.sin(x + me + t).astype(x.dtype), p)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    if where == "simulate":
        wrap = lambda f, **kw: od.simulate(f, **kw)
    else:
        mesh = jax.make_mesh((N,), ("replica",), devices=jax.devices()[:N])
        wrap = lambda f, **kw: od.on_mesh(f, mesh, **kw)
    results = []
    for donate in ((), (0, 1)):
        run = wrap(step, donate_argnums=donate)
        p = stacked(make_params())
        s = wrap(tx.init)(p)
        for t in range(3):
            p, s = run(p, s, jnp.full((N,), t, jnp.float32))
        results.append(jax.tree.leaves((p, s)))
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


# transforms whose update checks the kind of its state (one of each family: every periodic transform
# shares periodic.py's check)
STATE_CHECKED = [
    "allreduce",
    "averaged_iterate",
    "compressed_top_k",
    "daso",
    "demo",
    "diloco",
    "dynamic_loss_scale",
    "exact_warmup",
    "local_sgd",
    "powersgd",
]


@pytest.mark.parametrize("name", STATE_CHECKED)
def test_a_state_of_another_kind_is_named(name):
    tx = TRANSFORMS[name][0]()
    with pytest.raises(TypeError, match=r"\.update: got a state of type EmptyState, not the \w+State"):
        od.simulate(lambda p: tx.update(p, optax.EmptyState(), p))(stacked(make_params()))
