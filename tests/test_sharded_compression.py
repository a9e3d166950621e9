"""Compression of model-sharded replicas: with ``model_sharding``, each device compresses its own
block of every leaf, so nothing is gathered over a model axis; ``simulate`` computes the same
blocks; PowerSGD on a sharded matrix moves only factor-sized data over the model axis."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optaxdist as od
from optaxdist.bench.data import random_normal

COMM = od.AxisComm(od.REPLICA_AXIS)
C = od.compress
SPECS = {"w1": P(None, "model"), "w2": P("model", None), "b": P()}

COMPRESSORS = {
    "top_k": C.top_k(fraction=0.1),
    "random_k": C.random_k(fraction=0.1),
    "block_k": C.block_k(fraction=0.25),
    "sign": C.sign(),
    "scaled_sign": C.sign(scaled=True),
    "quantize": C.quantize(bits=4),
    "threshold": C.threshold(0.5),
    "cast_bf16": C.cast("bfloat16"),
}
ELEMENTWISE = ("threshold", "cast_bf16")


def _mesh(replicas, model):
    devices = np.asarray(jax.devices()[: replicas * model]).reshape(replicas, model)
    return jax.sharding.Mesh(
        devices, (od.REPLICA_AXIS, "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _grads(n, seed=0):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "w1": random_normal(k1, (n, 16, 32)),
        "w2": random_normal(k2, (n, 32, 8)),
        "b": random_normal(k3, (n, 8)),
    }


def _placed(tree, mesh):
    return jax.device_put(tree, {k: NamedSharding(mesh, P(od.REPLICA_AXIS, *SPECS[k])) for k in tree})


def _groups(line: str) -> list[list[int]]:
    """The device groups of one collective in HLO text (explicit, iota or permutation pairs)."""
    pairs = re.search(r"source_target_pairs=\{([\d,{}]*)\}", line)
    if pairs:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs.group(1))]
    explicit = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
    if explicit:
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", explicit.group(1))]
    named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if named:  # mesh['axis_0'=4,'axis_1'=2] {'axis_1'}: groups along the listed axes of that mesh
        axes = re.findall(r"'(\w+)'=(\d+)", named.group(1))
        along = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in named.group(2)]
        ids = np.arange(int(np.prod([int(size) for _, size in axes]))).reshape(
            [int(size) for _, size in axes]
        )
        across = [i for i in range(len(axes)) if i not in along]
        ids = ids.transpose(across + along)
        return ids.reshape(-1, int(np.prod([ids.shape[len(across) + k] for k in range(len(along))]))).tolist()
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    assert iota, line
    ids = np.arange(int(np.prod([int(d) for d in iota.group(3).split(",")])))
    ids = ids.reshape([int(d) for d in iota.group(3).split(",")])
    if iota.group(4):
        ids = ids.transpose([int(d) for d in iota.group(4).split(",")])
    return ids.reshape(int(iota.group(1)), int(iota.group(2))).tolist()


_COLLECTIVE = re.compile(
    r"=\s*(\(.*?\)|\S+)\s+(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
)
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "u16": 2, "u8": 1, "s8": 1, "pred": 1}


def collectives_by_axis(compiled_text: str, mesh) -> dict[str, list[tuple[str, int]]]:
    """``{"replica": [...], "model": [...]}``: (op, result bytes on one device) of each collective,
    by the mesh axes its groups run along (the first axis, or the others)."""
    position = {int(d.id): idx for idx, d in np.ndenumerate(mesh.devices)}
    out = {"replica": [], "model": []}
    for line in compiled_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        nbytes = sum(
            _BYTES[dt] * int(np.prod([int(d) for d in dims.split(",") if d]))
            for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        )
        groups = [[position[d] for d in g] for g in _groups(line)]
        same_replica = all(len({p[0] for p in g}) == 1 for g in groups)
        same_model = all(len({p[1:] for p in g}) == 1 for g in groups)  # every model axis
        assert same_replica != same_model, f"a collective over both axes: {line}"
        out["model" if same_replica else "replica"].append((m.group(2), nbytes))
    return out


def _run_both(tx, grads, mesh, steps=2):
    def step(g, s):
        return tx.update(g, s)

    sim = od.simulate(step)
    s_sim = od.simulate(tx.init)(grads)
    placed = _placed(grads, mesh)
    run = od.on_mesh(step, mesh, axis_name=od.REPLICA_AXIS)
    s_mesh = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)(placed)
    text = run.lower(placed, s_mesh).compile().as_text()
    for i in range(steps):
        g = jax.tree.map(lambda x, scale=1.0 + i: x * scale, grads)
        u_sim, s_sim = sim(g, s_sim)
        u_mesh, s_mesh = run(_placed(g, mesh), s_mesh)
    return (u_sim, s_sim), (u_mesh, s_mesh), text


def _close(a, b, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol)


# by default one compressor of each exchange (block_k: a key shared by the replicas; cast: a narrow
# all-reduce; sign: packed bits and its own combine; top_k and quantize: an all-gather, per leaf and
# per model); every compressor's bytes are checked unsharded in test_compress
FULL_RUN_ONLY = ("random_k", "scaled_sign", "quantize", "threshold")


@pytest.mark.parametrize(
    "name, scope",
    [
        pytest.param(n, "leaf", marks=pytest.mark.slow if n in FULL_RUN_ONLY else ())
        for n in sorted(COMPRESSORS)
    ]
    + [("top_k", "model"), ("quantize", "model")],
)
def test_each_device_compresses_its_own_block(name, scope):
    """Mesh = simulate with the same blocks; no collective over the model axis; residuals split
    like the parameters; the ledger counts what the replica's devices send between replicas."""
    mesh = _mesh(4, 2)
    grads = _grads(4)
    sharding = od.ModelSharding.from_mesh(mesh, SPECS, od.REPLICA_AXIS)
    tx = od.compressed_allreduce(COMPRESSORS[name], comm=COMM, scope=scope, model_sharding=sharding)
    (u_sim, s_sim), (u_mesh, s_mesh), text = _run_both(tx, grads, mesh)
    _close(u_sim, u_mesh)
    _close(s_sim.error, s_mesh.error)
    by_axis = collectives_by_axis(text, mesh)
    assert by_axis["model"] == []
    assert s_mesh.error["w1"].sharding.spec == P(od.REPLICA_AXIS, None, "model")
    assert s_mesh.error["w2"].sharding.spec == P(od.REPLICA_AXIS, "model")
    stats = od.comm_stats(s_mesh)
    assert stats.collectives == 2
    if name not in ("cast_bf16",):  # XLA:CPU sums bfloat16 in two phases (u16 bits), see test_accounting
        gathered = {"all-gather": 4, "all-reduce": 1}  # an all-gather's result holds every replica's payload
        per_device = sum(b // gathered[op] for op, b in by_axis["replica"])
        assert stats.bytes == 2 * per_device * sharding.devices


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_elementwise_compressors_give_the_unsharded_numbers(name):
    mesh = _mesh(2, 4)
    grads = _grads(2)
    specs = {"w1": P(None, "model"), "w2": P("model", None), "b": P("model")}
    sharding = od.ModelSharding.from_mesh(mesh, specs, od.REPLICA_AXIS)
    sharded = od.compressed_allreduce(COMPRESSORS[name], comm=COMM, model_sharding=sharding)
    whole = od.compressed_allreduce(COMPRESSORS[name], comm=COMM)

    def averaged(tx):
        return od.simulate(lambda g: tx.update(g, tx.init(g))[0])(grads)

    _close(averaged(sharded), averaged(whole))


def test_top_k_takes_k_per_block_under_both_scopes():
    """``fraction`` of each block is sent: the same share of the leaf, chosen block by block."""
    mesh = _mesh(2, 4)
    grads = _grads(2)
    sharding = od.ModelSharding.from_mesh(mesh, SPECS, od.REPLICA_AXIS)
    for scope in ("leaf", "model"):
        tx = od.compressed_allreduce(C.top_k(count=1), comm=COMM, scope=scope, model_sharding=sharding)
        u = od.simulate(lambda g, tx=tx: tx.update(g, tx.init(g))[0])(grads)
        # one entry per block of each split leaf (4 blocks), per replica (2 replicas, disjoint or not)
        blocks = np.asarray(u["w1"][0]).reshape(16, 4, 8).transpose(1, 0, 2).reshape(4, -1)
        assert ((blocks != 0).sum(axis=1) <= 2).all() and (blocks != 0).sum(axis=1).min() >= 1, scope
        (u_sim, _), (u_mesh, _), _ = _run_both(tx, grads, mesh, steps=1)
        _close(u_sim, u_mesh)


def test_powersgd_moves_only_factors_over_the_model_axis():
    """PowerSGD needs no ``model_sharding``: the compiler keeps ``MQ``, ``MᵀP`` and the residual
    split and reduces only ``n×r`` / ``m×r`` pieces over the model axis; between replicas the
    devices of a replica send the factors once between them (the ledger's bytes)."""
    mesh = _mesh(2, 4)
    k1, k2 = jax.random.split(jax.random.key(1))
    grads = {"w1": random_normal(k1, (2, 64, 128)), "w2": random_normal(k2, (2, 128, 64))}
    specs = {"w1": P(None, "model"), "w2": P("model", None)}
    rank = 2
    tx = od.powersgd(comm=COMM, rank=rank, warmup_steps=0)

    def step(g, s):
        return tx.update(g, s)

    placed = jax.device_put(grads, {k: NamedSharding(mesh, P(od.REPLICA_AXIS, *specs[k])) for k in grads})
    s = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)(placed)
    run = od.on_mesh(step, mesh, axis_name=od.REPLICA_AXIS)
    by_axis = collectives_by_axis(run.lower(placed, s).compile().as_text(), mesh)
    factors = 4 * rank * sum(n + m for n, m in ((64, 128), (128, 64)))
    matrix = 4 * 64 * 128
    assert by_axis["model"], "expected the small reductions of P and Q over the model axis"
    assert max(b for _, b in by_axis["model"]) <= factors < matrix // 10
    u, s = run(placed, s)
    ledger = od.comm_stats(s).bytes
    assert ledger == factors
    # the compiler splits each factor's all-reduce over the 4 devices of a replica
    assert 4 * sum(b for op, b in by_axis["replica"] if op == "all-reduce") == ledger
    _close(u, od.simulate(step)(grads, od.simulate(tx.init)(grads))[0], atol=1e-5)
    assert s.powersgd_error[0].sharding.spec == P(od.REPLICA_AXIS, None, None, "model")


def test_bad_model_sharding_is_refused_clearly():
    mesh = _mesh(4, 2)
    with pytest.raises(ValueError, match=r"replica_axes \['data'\] are not axes of the mesh"):
        od.ModelSharding.from_mesh(mesh, SPECS, "data")
    with pytest.raises(
        ValueError, match=r"names axis 'replica', which is not a model axis; allowed: \('model',\)"
    ):
        od.ModelSharding.from_mesh(mesh, {"w": P(od.REPLICA_AXIS)}, od.REPLICA_AXIS)
    with pytest.raises(TypeError, match=r"specs\['w'\]=None must be a jax.sharding.PartitionSpec"):
        od.ModelSharding({"w": None}, (("model", 2),))
    for sizes in ((("model", 0),), (("model", 2.0),), (("model", True),), (), "model", (("model",),)):
        with pytest.raises(ValueError, match=r"axis_sizes=.* must be a non-empty tuple of \(model axis name"):
            od.ModelSharding({"w": P("model")}, sizes)
    numpy_sizes = od.ModelSharding({"w": P("model")}, [("model", np.int64(2))])  # a sweep's sizes
    assert numpy_sizes == od.ModelSharding({"w": P("model")}, (("model", 2),))
    assert type(numpy_sizes.axis_sizes[0][1]) is int
    sharding = od.ModelSharding.from_mesh(mesh, SPECS, od.REPLICA_AXIS)
    tx = od.compressed_allreduce(C.top_k(fraction=0.1), comm=COMM, model_sharding=sharding)
    with pytest.raises(ValueError, match=r"specs must have the structure of the parameters"):
        tx.init({"w1": jnp.zeros((16, 32))})
    bad = od.ModelSharding.from_mesh(mesh, {"w1": P("model"), "w2": P(), "b": P()}, od.REPLICA_AXIS)
    indivisible = r"specs\['w1'\]=P\('model',\): dimension 0 .* is 15, not divisible by 2"
    with pytest.raises(ValueError, match=indivisible):
        od.compressed_allreduce(C.top_k(fraction=0.1), comm=COMM, model_sharding=bad).init(
            {"w1": jnp.zeros((15, 4)), "w2": jnp.zeros((4,)), "b": jnp.zeros(())}
        )
    with pytest.raises(TypeError, match="model_sharding must be an optaxdist.ModelSharding"):
        od.compressed_allreduce(C.top_k(fraction=0.1), comm=COMM, model_sharding=SPECS)
    # the model axis made a replica axis: the blocks cannot be the compiler's
    grads = _grads(4)
    run = od.on_mesh(lambda g: tx.update(g, tx.init(g))[0], mesh, axis_name=(od.REPLICA_AXIS, "model"))
    with pytest.raises(ValueError, match=r"model axes \['model'\] of the ModelSharding are manual"):
        run(jax.tree.map(lambda x: jnp.concatenate([x, x]), grads))


@pytest.mark.parametrize(
    "axes, specs",
    [
        (("model",), {"w1": P(None, "model"), "w2": P("model", None), "b": P()}),
        pytest.param(
            ("fsdp", "tensor"),
            {"w1": P("fsdp", "tensor"), "w2": P("fsdp", None), "b": P()},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["rows-and-columns", "two-model-axes"],
)
def test_powersgd_with_model_sharding_sends_what_its_ledger_says(axes, specs):
    """Each device multiplies its own block; the sums over the model axes are explicit and in the
    ledger (scope "model"); a factor block the same on several devices is sent between replicas
    once, in pieces; the numbers are PowerSGD's on the whole matrices."""
    replicas = 2
    shape = (replicas,) + (2,) * len(axes) if len(axes) > 1 else (replicas, 4)
    devices = np.asarray(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    names = (od.REPLICA_AXIS, *axes)
    mesh = jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    grads = {
        "w1": random_normal(k1, (replicas, 64, 128)),
        "w2": random_normal(k2, (replicas, 128, 64)),
        "b": random_normal(k3, (replicas, 64)),
    }
    sharding = od.ModelSharding.from_mesh(mesh, specs, od.REPLICA_AXIS)
    tx = od.powersgd(comm=COMM, rank=2, warmup_steps=1, model_sharding=sharding)
    plain = od.powersgd(comm=COMM, rank=2, warmup_steps=1)

    def step(tx):
        return lambda g, s: tx.update(g, s)

    placed = jax.device_put(grads, {k: NamedSharding(mesh, P(od.REPLICA_AXIS, *specs[k])) for k in grads})
    s_mesh = od.on_mesh(tx.init, mesh, axis_name=od.REPLICA_AXIS)(placed)
    run = od.on_mesh(step(tx), mesh, axis_name=od.REPLICA_AXIS)
    run_sim, run_plain = od.simulate(step(tx)), od.simulate(step(plain))
    s_sim, s_plain = od.simulate(tx.init)(grads), od.simulate(plain.init)(grads)
    for i in range(3):  # a warm-up step, then compressed ones
        g = jax.tree.map(lambda x, scale=1.0 + i: x * scale, grads)
        u_mesh, s_mesh = run(jax.device_put(g, jax.tree.map(lambda x: x.sharding, placed)), s_mesh)
        u_sim, s_sim = run_sim(g, s_sim)
        u_plain, s_plain = run_plain(g, s_plain)
    _close(u_mesh, u_sim, atol=1e-5)
    _close(u_sim, u_plain, atol=1e-5)
    assert s_mesh.powersgd_error[0].sharding.spec == P(
        od.REPLICA_AXIS, None, *sharding.matrix_axes(specs["w1"], 2)
    )
    assert s_mesh.powersgd_q[0].sharding.spec == P(od.REPLICA_AXIS, None, specs["w1"][1])

    text = run.lower(placed, s_mesh).compile().as_text()
    by_axis = collectives_by_axis(text, mesh)
    d = sharding.devices
    ledger = s_mesh.powersgd_ledger
    stats = dict(zip(ledger.kinds, ledger.payloads))  # bytes of one event of each kind
    compressed = stats["powersgd_p[float32]"] + stats["powersgd_q[float32]"] + stats["all_reduce[float32]"]
    warmup = stats["powersgd_warmup[float32]"]
    replica = sorted(b for op, b in by_axis["replica"] if op == "all-reduce")
    assert d * sum(replica) == compressed + warmup  # both branches of the step, as the ledger says
    model = [(op, b) for op, b in by_axis["model"]]
    sums = sum(b for op, b in model if op == "all-reduce" and b > 4 * 2 * 3)  # not Gram–Schmidt's
    assert d * sums == stats["model:powersgd_p[float32]"] + stats.get("model:powersgd_q[float32]", 0)
    members = shape[-1]  # every model axis here has the same size: each member hands 1/size
    gathered = sum(b // members for op, b in model if op == "all-gather")
    assert d * gathered == stats.get("model:powersgd_factors[float32]", 0)
    assert all(op in ("all-reduce", "all-gather") for op, _ in model), model
