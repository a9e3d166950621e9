"""The two-phase quantized all-reduce: ``quantize(exchange="two_phase")`` in ``compressed_allreduce``
(all-to-all of chunks, float32 mean and re-quantization per chunk, all-gather), against a NumPy model
of the same scheme, bit for bit."""

import json
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist import compress
from tests.test_accounting import compiled_wire_bytes, ledger_wire_bytes
from tests.test_compress import np_float8

W = 8
SHAPES = {"kernel": (13, 31), "bias": (37,)}  # 403 and 37 values: no multiple of W·block_size


def grads(n, steps=2, seed=0):
    """``steps`` gradients per replica, with magnitudes spread over several orders per leaf."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        size = int(np.prod(shape))
        spread = np.logspace(-3, 1, size).astype(np.float32).reshape(shape)
        out[name] = (rng.normal(size=(steps, n, *shape)) * spread).astype(np.float32)
    return out


# ---- the NumPy model ---------------------------------------------------------------------------


def np_encode(c, x):
    """Integers or 8-bit floats (as float32) and scales of ``x`` (whole blocks), the arithmetic of
    ``Quantize``."""
    blocks = np.pad(x, (0, -x.size % c.block_size)).reshape(-1, c.block_size)
    scale = np.abs(blocks).max(1) * np.float32(1 / c.levels)
    inverse = np.float32(1) / np.where(scale > 0, scale, np.float32(1))
    scaled = blocks * inverse[:, None]
    if c.format != "int":
        return np_float8(np.clip(scaled, -c.levels, c.levels), c.format), scale
    return np.clip(np.round(scaled), -c.levels, c.levels), scale


def np_decode(ints, scale):
    return (ints * scale[:, None]).reshape(-1)


def np_two_phase(c, vs):
    """Each replica's vector in ``vs`` ([W, d]) quantized in W chunks of whole blocks; replica j
    adds the W decoded chunks j in member order, multiplies by fl(1/W), re-quantizes; everybody
    decodes the W re-quantized chunks. Returns the mean and each replica's residual."""
    w, d = vs.shape
    chunk = c.chunk_size(d, w)
    first = [np_decode(*np_encode(c, np.pad(v, (0, w * chunk - d)))).reshape(w, chunk) for v in vs]
    out = []
    for j in range(w):
        total = first[0][j]
        for i in range(1, w):
            total = total + first[i][j]
        out.append(np_decode(*np_encode(c, total * np.float32(1 / w))))
    residual = np.stack([v - f.reshape(-1)[:d] for v, f in zip(vs, first)])
    return np.concatenate(out)[:d], residual


def np_steps(c, g, error_feedback):
    """The model over the steps of ``g`` (leaf → [steps, W, *shape]): outputs and final residuals."""
    outs, errors = [], {}
    for t in range(next(iter(g.values())).shape[0]):
        step = {}
        for name, x in g.items():
            vs = x[t].reshape(x.shape[1], -1)
            if error_feedback and name in errors:
                vs = vs + errors[name]
            mean, residual = np_two_phase(c, vs)
            step[name] = np.broadcast_to(mean.reshape(x.shape[2:]), x.shape[1:])
            errors[name] = residual
        outs.append(step)
    return outs, errors


def run_steps(harness, c, g, error_feedback):
    tx = od.compressed_allreduce(c, comm=harness.comm, error_feedback=error_feedback)

    def steps(*per_step):
        state = tx.init(per_step[0])
        outs = []
        for x in per_step:
            u, state = tx.update(x, state)
            outs.append(u)
        return outs, state

    per_step = [jax.tree.map(lambda x, t=t: x[t], g) for t in range(2)]
    return harness.run(steps, *per_step)


# ---- the communicator's all-to-all ----------------------------------------------------------------


def test_all_to_all_transposes_rows_across_members(harness):
    n = harness.n
    rows = np.arange(n * n * 3).reshape(n, n, 3)  # member i's row j: rows[i, j]
    tree = {"u8": rows.astype(np.uint8), "bf16": rows.astype(jnp.bfloat16), "f32": rows.astype(np.float32)}
    out = harness.run(harness.comm.all_to_all, tree)
    for name, x in tree.items():
        np.testing.assert_array_equal(out[name], np.swapaxes(x, 0, 1), err_msg=name)
        assert out[name].dtype == x.dtype
    with pytest.raises(ValueError, match="leading axis"):
        harness.run(harness.comm.all_to_all, np.zeros((n, n + 1, 2), np.float32))


def test_all_to_all_over_two_axes_is_one_flat_group():
    """``AxisComm(("node", "local"))``: ``lax.all_to_all`` over both axes on a mesh, the gathered
    column under nested vmap (no multi-axis all-to-all there); member order is row-major."""
    rows = np.arange(8 * 8 * 3, dtype=np.float32).reshape(8, 8, 3)
    sim = od.axis_hierarchy(2, 4)
    out = od.simulate(sim.world.all_to_all, axis_name=("node", "local"), shape=(2, 4))(rows)
    np.testing.assert_array_equal(out, np.swapaxes(rows, 0, 1))
    mesh = od.mesh_hierarchy(2, 4)
    spec = jax.sharding.PartitionSpec(("node", "local"))
    on_mesh = jax.shard_map(
        lambda r: mesh.world.all_to_all(r[0])[None], mesh=mesh.mesh, in_specs=spec, out_specs=spec
    )
    np.testing.assert_array_equal(jax.jit(on_mesh)(rows), np.swapaxes(rows, 0, 1))


# ---- bit for bit -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits, block_size, fmt",
    # e5m2 shares e4m3's code path (the full run has it)
    [
        (8, 64, "int"),
        (4, 16, "int"),
        (2, 8, "int"),
        (8, 64, "e4m3"),
        pytest.param(8, 16, "e5m2", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("error_feedback", [True, False], ids=["ef", "no_ef"])
@pytest.mark.sample("ef-4-16-int", "no_ef-8-64-e4m3")  # every format sends the same u8 + f32 payloads
def test_two_phase_equals_numpy_model_bit_for_bit(harness, bits, block_size, fmt, error_feedback):
    c = compress.quantize(bits, block_size=block_size, exchange="two_phase", format=fmt)
    g = grads(harness.n)
    outs, state = run_steps(harness, c, g, error_feedback)
    want, errors = np_steps(c, g, error_feedback)
    for got, ref in zip(outs, want):
        for name in g:
            np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    if error_feedback:
        for name in SHAPES:
            np.testing.assert_array_equal(state.error[name].reshape(harness.n, -1), errors[name])


def test_decode_is_the_rounded_product_whatever_xla_fuses():
    """``decode`` is fl(n·s) even where XLA fuses it with an add (a fused multiply-add would skip the
    product's rounding); a plain ``ints * scale`` feeding the add differs in about a quarter of the
    values on this CPU."""
    c = compress.quantize(8, block_size=4)
    rng = np.random.default_rng(3)
    x = (rng.normal(size=4096) * np.logspace(-4, 4, 4096)).astype(np.float32)
    acc = rng.normal(size=4096).astype(np.float32)
    payload = c.encode(jnp.asarray(x), None)
    got = jax.jit(lambda p, a: a + c.decode(p, 4096, None))(payload, acc)
    ints, scale = np_encode(c, x)
    np.testing.assert_array_equal(np.asarray(got), acc + np_decode(ints, scale))


# ---- accuracy ----------------------------------------------------------------------------------


def test_close_to_the_exact_mean_within_the_block_scales():
    """|two-phase − mean| ≤ mean_i s_i/2 (each replica's first quantization, its own block scales)
    + s'/2 (the re-quantization, the scales of the mean of the decoded chunks), per value."""
    c = compress.quantize(8, block_size=8, exchange="two_phase")
    g = jax.tree.map(lambda x: x[0], grads(W, steps=1))
    tx = od.compressed_allreduce(c, comm=od.AxisComm("replica"), error_feedback=False)
    out, _ = od.simulate(lambda x: tx.update(x, tx.init(x)))(g)
    for name, x in g.items():
        vs = x.reshape(W, -1)
        d = vs.shape[1]
        padded = np.pad(vs, ((0, 0), (0, W * c.chunk_size(d, W) - d)))
        first = [np_encode(c, v) for v in padded]
        decoded_mean = np.mean([np_decode(*f) for f in first], axis=0)
        second_scales = np_encode(c, decoded_mean)[1]
        bound = np.repeat(np.mean([s for _, s in first], axis=0) / 2 + second_scales / 2, 8)[:d]
        exact = vs.astype(np.float64).mean(0)
        err = np.abs(np.asarray(out[name][0], np.float64).reshape(-1) - exact)
        assert (err <= bound * (1 + 1e-5)).all(), name
        assert err.max() <= 1e-2 * np.abs(exact).max(), name  # 8 bits per value: close


# ---- accounting --------------------------------------------------------------------------------


def test_ledger_equals_compiled_collectives_and_beats_the_all_gather():
    mesh = jax.make_mesh((W,), ("replica",), axis_types=(jax.sharding.AxisType.Auto,))
    g = jax.tree.map(lambda x: x[0], grads(W, steps=1))
    sent = {}
    for exchange in ("two_phase", "all_gather"):
        tx = od.compressed_allreduce(compress.quantize(8, exchange=exchange), comm=od.AxisComm("replica"))
        fn = od.on_mesh(lambda x, tx=tx: tx.update(x, tx.init(x)), mesh)
        stats = od.comm_stats(fn(g)[1])
        wire = compiled_wire_bytes(fn, g)
        assert sum(wire.values()) == pytest.approx(ledger_wire_bytes(stats, W))
        assert set(wire) == {"u8", "f32"}  # packed codes and scales, nothing widened
        sent[exchange] = ledger_wire_bytes(stats, W)
        if exchange == "two_phase":
            assert set(stats.by_kind) == {"all_to_all[int8/64]", "all_gather[int8/64]"}
            # kernel 403 values: 8 chunks of 64 (one block each); bias 37: 8 chunks of 64
            chunk = 64 + 4
            assert stats.by_kind["all_to_all[int8/64]"] == od.KindTotals(1, 2 * W * chunk)
            assert stats.by_kind["all_gather[int8/64]"] == od.KindTotals(1, 2 * chunk)
    assert sent["two_phase"] < sent["all_gather"]


# ---- composition and errors ----------------------------------------------------------------------


# vmap's all-to-all runs in the bit-for-bit tests; the chain and DiLoCo on the mesh by default
@pytest.mark.sample(harnesses=("vmap",))
def test_in_a_chain_under_jit_and_in_diloco_with_the_start_check(harness):
    c = compress.quantize(8, block_size=16, exchange="two_phase")
    g = jax.tree.map(lambda x: x[0], grads(harness.n, steps=1))
    tx = optax.chain(od.compressed_allreduce(c, comm=harness.comm), optax.sgd(0.1))

    def chain_step(x):
        s = tx.init(x)
        u, s = tx.update(x, s, x)
        return jax.jit(lambda x, s: tx.update(x, s, x))(x, s)

    u, s = harness.run(chain_step, g)
    for name in g:
        np.testing.assert_array_equal(u[name], np.broadcast_to(u[name][0], u[name].shape))
    assert od.comm_stats(s).by_kind["all_to_all[int8/16]"].collectives == 2

    diloco = od.diloco(
        optax.sgd(0.1), comm=harness.comm, period=2, reducer=od.compressed_allreduce(c, comm=harness.comm)
    )
    params = od.replicate(jax.tree.map(lambda x: jnp.zeros(x.shape[1:]), g), harness.n)

    def four_steps(p, x):
        s = diloco.init(p)
        for _ in range(4):
            u, s = diloco.update(x, s, p)
            p = optax.apply_updates(p, u)
        return p, s

    p, s = harness.run(four_steps, params, g)
    stats = od.comm_stats(s).by_kind
    assert stats["broadcast[start check]"].collectives == 1
    assert stats["all_to_all[int8/16]"].collectives == stats["all_gather[int8/16]"].collectives == 2
    od.assert_replicas_identical(s.sync_state.anchors)  # the outer step saw the same average
    np.testing.assert_allclose(p["bias"], np.broadcast_to(p["bias"][0], p["bias"].shape), atol=1e-6)


def test_bad_exchange_and_hierarchical_groups_refuse():
    with pytest.raises(ValueError, match=r"exchange='ring'; allowed: \('all_gather', 'two_phase'\)"):
        compress.quantize(8, exchange="ring")
    from optaxdist.comm.cross import CrossComm
    from optaxdist.comm.node import NodeComm

    cross = CrossComm(exchange=SimpleNamespace(size=2), local_axis="local", local_size=4)
    for comm in (NodeComm(cross), cross):
        with pytest.raises(NotImplementedError, match='exchange="two_phase"'):
            comm.all_to_all(jnp.zeros((comm.size, 3)))
    with pytest.raises(NotImplementedError, match='exchange="two_phase"'):
        NodeComm(cross).by_level("all_to_all", [(64, 1)])
    for comm in (NodeComm(cross), cross):  # at construction, before any step
        with pytest.raises(NotImplementedError, match='exchange="two_phase"'):
            od.compressed_allreduce(compress.quantize(8, exchange="two_phase"), comm=comm)


@pytest.mark.slow
def test_two_phase_equals_numpy_model_under_mpirun(tmp_path):
    """The harness tests of this file (the bit-for-bit ones included) on 2 MPI ranks (``MpiComm``:
    ``mpi4jax.alltoall`` and ``allgather``)."""
    import os
    import subprocess
    import sys

    from tests.test_mpi import ROOT, _mpirun

    env = dict(
        os.environ,
        OPTAXDIST_MPI="1",
        OPTAXDIST_MPI_RESULTS=str(tmp_path),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    env.pop("XLA_FLAGS", None)
    env.pop("OPTAXDIST_NODE_DEVICES", None)
    cmd = [_mpirun(), "-n", "2", sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    proc = subprocess.run(
        [*cmd, "tests/test_quantized_allreduce.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == 2 and all(r["failed"] == 0 and r["passed"] >= 8 for r in results), results


def test_init_outside_the_harness_says_where_to_call_it():
    tx = od.compressed_allreduce(compress.quantize(8, exchange="two_phase"), comm=od.AxisComm("replica"))
    with pytest.raises(ValueError, match="needs the group size at init"):
        tx.init({"w": jnp.zeros(10)})


def test_model_sharded_replicas_run_two_phase_per_block():
    """With ``model_sharding`` each device runs the two phases on its own blocks between replicas:
    the mesh gives simulate's bits, nothing crosses the model axis, and the ledger counts the
    replica's devices' all-to-all and all-gather payloads."""
    from tests.test_sharded_compression import COMM, SPECS, _grads, _mesh, _run_both, collectives_by_axis

    mesh = _mesh(4, 2)
    sharding = od.ModelSharding.from_mesh(mesh, SPECS, od.REPLICA_AXIS)
    c = compress.quantize(4, block_size=8, exchange="two_phase")
    tx = od.compressed_allreduce(c, comm=COMM, model_sharding=sharding)
    (u_sim, s_sim), (u_mesh, s_mesh), text = _run_both(tx, _grads(4), mesh)
    for a, b in zip(jax.tree.leaves((u_sim, s_sim.error)), jax.tree.leaves((u_mesh, s_mesh.error))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    by_axis = collectives_by_axis(text, mesh)
    assert by_axis["model"] == []
    stats = od.comm_stats(s_mesh)
    assert {k: t.collectives for k, t in stats.by_kind.items()} == {
        "all_to_all[int4/8]": 2,
        "all_gather[int4/8]": 2,
    }
    result_per_payload = {"all-to-all": 1, "all-gather": 4}  # an all-gather's result: 4 replicas' chunks
    per_device = sum(b // result_per_payload[op] for op, b in by_axis["replica"])
    assert stats.bytes == 2 * per_device * sharding.devices
