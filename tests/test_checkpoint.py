"""Checkpoint and resume (orbax): every public transform on every harness resumes bit-identically.

Save at step K, restore into a fresh init in a new run, continue to 2K: every leaf of params and
state (ledger counters included) equals the uninterrupted run's, bit for bit. ``simulate`` and
``on_mesh`` run in this process; MPI (``mpirun -n 2``) and ``jax.distributed`` (2 processes) run
tests/ckpt_worker.py. A checkpoint of another configuration is refused with a message naming what
differs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import optaxdist as od
from tests.ckpt_common import NAMES, K, assert_trees_identical, data, fast_or_slow, make, params_row, step_fn

ROOT = Path(__file__).resolve().parents[1]
N = 8
COMM = od.AxisComm(od.REPLICA_AXIS)
# compiled (init, step) per (transform, harness, replicas); shared with tests/test_elastic.py
_COMPILED: dict = {}
MESH_FAST = ("compressed_top_k", "slowmo_memory_efficient")  # mesh cases run by default


def compiled(name: str, harness: str, n: int):
    key = (name, harness, n)
    if key not in _COMPILED:
        tx = make(name, COMM, n)
        if harness == "vmap":
            wrap = od.simulate
        else:
            mesh = jax.make_mesh(
                (n,), (od.REPLICA_AXIS,), devices=jax.devices()[:n], axis_types=(jax.sharding.AxisType.Auto,)
            )
            wrap = lambda f: od.on_mesh(f, mesh)  # noqa: E731
        _COMPILED[key] = (wrap(lambda p: (p, tx.init(p))), wrap(step_fn(tx)), tx)
    return _COMPILED[key]


def run_steps(name, harness, n, state, first, last, xs, ys):
    _, step, _ = compiled(name, harness, n)
    for t in range(first, last):
        state = step(*state, xs[t], ys[t])
    return state


def fresh(name, harness, n=N):
    init, _, _ = compiled(name, harness, n)
    return init(od.replicate(params_row(), n))


def check_resume(name, harness, tmp_path):
    xs, ys = data(N, 2 * K)
    reference = jax.tree.map(np.asarray, run_steps(name, harness, N, fresh(name, harness), 0, 2 * K, xs, ys))
    saved = run_steps(name, harness, N, fresh(name, harness), 0, K, xs, ys)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        od.save_checkpoint(manager, K, saved)
        manager.wait_until_finished()
    del saved

    start = fresh(name, harness)  # the new run: fresh init, then restore over it
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        restored = od.restore_checkpoint(manager, None, start)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(start)):
        assert a.sharding == b.sharding  # global arrays come back with the fresh state's shardings
    resumed = run_steps(name, harness, N, restored, K, 2 * K, xs, ys)
    assert_trees_identical(jax.tree.map(np.asarray, resumed), reference, f"{name}/{harness}: ")
    # the ledgers were restored, not restarted: they count all 2K steps
    assert od.comm_stats(resumed[1]) == od.comm_stats(reference[1])


@pytest.mark.parametrize("name", fast_or_slow())
def test_resume_is_bit_identical_simulate(name, tmp_path):
    check_resume(name, "vmap", tmp_path)


@pytest.mark.parametrize("name", fast_or_slow(fast=MESH_FAST))
def test_resume_is_bit_identical_mesh(name, tmp_path):
    check_resume(name, "mesh", tmp_path)


def test_a_changed_state_is_not_bit_identical(tmp_path):
    """The comparison can fail: a small change of one residual after the restore shows at 2K."""
    name, harness = "compressed_top_k", "vmap"
    xs, ys = data(N, 2 * K)
    reference = jax.tree.map(np.asarray, run_steps(name, harness, N, fresh(name, harness), 0, 2 * K, xs, ys))
    params, state = run_steps(name, harness, N, fresh(name, harness), 0, K, xs, ys)
    err = state.error["w"]
    err = err.at[3, 0, 0].add(jnp.float32(1e-3))
    state = state._replace(error=dict(state.error, w=err))
    resumed = run_steps(name, harness, N, (params, state), K, 2 * K, xs, ys)
    with pytest.raises(AssertionError):
        assert_trees_identical(jax.tree.map(np.asarray, resumed), reference)


# ---------------------------------------------------------------- another configuration's checkpoint


@pytest.fixture(scope="module")
def top_k_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "top_k"
    with ocp.CheckpointManager(path) as manager:
        od.save_checkpoint(manager, 1, fresh("compressed_top_k", "vmap"))
        manager.wait_until_finished()
    return path


def _restore(path, like):
    with ocp.CheckpointManager(path) as manager:
        return od.restore_checkpoint(manager, 1, like)


def test_other_transform_is_refused(top_k_checkpoint):
    with pytest.raises(od.CheckpointMismatchError, match=r"powersgd_step.*\n.*compress_step"):
        _restore(top_k_checkpoint, fresh("powersgd", "vmap"))


def test_other_hyperparameters_are_refused(top_k_checkpoint):
    """Same leaves, but top-k of another fraction sends another payload: the ledger's static data
    (and so the tree structure) differs."""
    tx = make("compressed_top_k", COMM, N)
    other = od.compressed_allreduce(od.compress.top_k(fraction=0.25), comm=COMM)
    params = od.replicate(params_row(), N)
    like = (params, jax.eval_shape(jax.vmap(other.init), params))
    assert (
        jax.tree.leaves(like[1])[0].shape
        == jax.tree.leaves(jax.eval_shape(jax.vmap(tx.init), params))[0].shape
    )
    with pytest.raises(od.CheckpointMismatchError, match="ledger kinds/payloads"):
        _restore(top_k_checkpoint, like)


def test_other_dtype_shape_and_world_size_are_refused(top_k_checkpoint):
    params, state = fresh("compressed_top_k", "vmap")
    bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    with pytest.raises(
        od.CheckpointMismatchError,
        match=r"\['w'\]: checkpoint has shape \[8, 3, 2\] float32, this run \[8, 3, 2\] bfloat16",
    ):
        _restore(top_k_checkpoint, (bf16, state))
    with pytest.raises(od.CheckpointMismatchError, match="resize_replicas"):
        _restore(top_k_checkpoint, fresh("compressed_top_k", "vmap", 4))


def test_missing_field_is_refused(top_k_checkpoint):
    params, state = fresh("compressed_top_k", "vmap")
    with pytest.raises(
        od.CheckpointMismatchError, match=r"in the checkpoint but not in this run's state: \[1\]"
    ):
        _restore(top_k_checkpoint, (params,))
    with pytest.raises(od.CheckpointMismatchError, match=r"missing in the checkpoint: \[2\]"):
        _restore(top_k_checkpoint, (params, state, {"extra": jnp.zeros(N)}))


def test_plain_orbax_checkpoint_is_refused(tmp_path):
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave({"a": jnp.zeros(2)})))
        manager.wait_until_finished()
    with pytest.raises(od.CheckpointMismatchError, match="no optaxdist description"):
        _restore(tmp_path, {"a": jnp.zeros(2)})


def test_typed_prng_keys_round_trip(tmp_path):
    tree = {"keys": jax.random.split(jax.random.key(0), N), "w": jnp.ones((N, 2))}
    with ocp.CheckpointManager(tmp_path) as manager:
        od.save_checkpoint(manager, 1, tree)
        manager.wait_until_finished()
    back = _restore(tmp_path, {"keys": jax.random.split(jax.random.key(1), N), "w": jnp.zeros((N, 2))})
    assert jax.dtypes.issubdtype(back["keys"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(back["keys"]), jax.random.key_data(tree["keys"]))


def test_restore_stacked_reads_the_stacked_layout(top_k_checkpoint):
    tx = make("compressed_top_k", COMM, N)
    row = jax.eval_shape(lambda p: (p, tx.init(p)), params_row())
    stacked = od.restore_stacked(top_k_checkpoint, None, row)
    assert_trees_identical(stacked, jax.tree.map(np.asarray, fresh("compressed_top_k", "vmap")))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(stacked))


# ---------------------------------------------------------------- multi-process harnesses


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _results(tmp_path, nproc, names):
    results = [json.loads((tmp_path / f"result{i}.json").read_text()) for i in range(nproc)]
    for r in results:
        assert r["results"] == dict.fromkeys(names, "ok"), r
    return results


MPI_FAST, MULTIHOST_FAST = "compressed_top_k", "powersgd"


@pytest.mark.parametrize(
    "names",
    [[MPI_FAST], pytest.param([n for n in NAMES if n != MPI_FAST], marks=pytest.mark.slow)],
    ids=["one", "all"],
)
def test_resume_under_mpirun(names, tmp_path):
    from tests.test_mpi import _mpirun

    cmd = [
        _mpirun(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "tests.ckpt_worker",
        "mpi",
        str(tmp_path),
        ",".join(names),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    results = _results(tmp_path, 2, names)
    assert sorted(r["rows"][0] for r in results) == [0, 1]
    # the per-rank layout reads back as one stacked tree (what elastic restarts take)
    tx = make(names[0], COMM, 2)
    row = jax.eval_shape(lambda p: (p, tx.init(p)), params_row())
    assert sorted(p.name for p in (tmp_path / names[0]).iterdir()) == [
        "rank00000-of-00002",
        "rank00001-of-00002",
    ]
    params, state = od.restore_stacked(tmp_path / names[0], K, row)
    assert params["w"].shape == (2, 3, 2)
    assert od.comm_stats(state).collectives == K
    # ... and resizes like any other (an MPI job restarted with 4 ranks)
    params4, state4 = od.resize_replicas(params, state, 4)
    like4 = jax.eval_shape(jax.vmap(make(names[0], COMM, 4).init), od.replicate(params_row(), 4))
    assert jax.tree.structure(state4) == jax.tree.structure(like4)
    assert params4["w"].shape == (4, 3, 2)
    # a rank directory missing: refused
    (tmp_path / "broken" / "rank00001-of-00002").mkdir(parents=True)
    with pytest.raises(od.CheckpointMismatchError, match="incomplete or mixed MPI layout"):
        od.restore_stacked(tmp_path / "broken", K, row)


@pytest.mark.parametrize(
    "names",
    [[MULTIHOST_FAST], pytest.param([n for n in NAMES if n != MULTIHOST_FAST], marks=pytest.mark.slow)],
    ids=["one", "all"],
)
def test_resume_under_jax_distributed(names, tmp_path):
    port, nproc = _free_port(), 2
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.ckpt_worker",
                "multihost",
                str(tmp_path),
                ",".join(names),
                str(i),
                str(nproc),
                str(port),
            ],
            cwd=ROOT,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    results = _results(tmp_path, nproc, names)
    assert sorted(row for r in results for row in r["rows"]) == [0, 1, 2, 3]
    # one checkpoint of global arrays, written by both processes: 4 stacked replicas
    tx = make(names[0], COMM, 4)
    row = jax.eval_shape(lambda p: (p, tx.init(p)), params_row())
    params, _ = od.restore_stacked(tmp_path / names[0], K, row)
    assert params["w"].shape == (4, 3, 2)


def test_a_world_size_mismatch_leads_with_the_resize_hint_however_many_leaves_differ():
    from optaxdist.checkpoint import check_description, describe

    def state(replicas):
        return {f"w{i:02d}": np.zeros((replicas, 3), np.float32) for i in range(20)}

    with pytest.raises(od.CheckpointMismatchError) as info:
        check_description(describe(state(4)), describe(state(8)))
    lines = str(info.value).splitlines()
    assert "resize_replicas" in lines[1]
    assert lines[-1].strip() == "... and 9 more"  # 20 leaves and the hint, 12 shown
    assert len(lines) == 1 + 12 + 1
