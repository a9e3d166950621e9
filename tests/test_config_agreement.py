"""Configuration agreement: a process whose configuration differs gets a clear error, never a hang.

In one process the descriptions of two configurations are compared directly; under ``mpirun -n 2``
and two ``jax.distributed`` processes, process 1 runs a configuration that differs from process 0's
in one thing per case, and every process must raise the same error within seconds.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optaxdist as od
from optaxdist import agreement

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "config_agreement_worker.py"
CASES_ON_MULTIHOST = ("local_sgd period", "allreduce wire dtype", "top_k vs random_k", "parameter shape")


def describe(tx, params):
    with jax.numpy_dtype_promotion("standard"):
        comm_state = od.simulate(tx.init)(od.replicate(params, 2))
    stacked = od.replicate(params, 2)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    with jax.numpy_dtype_promotion("standard"):  # optax.adam's count arithmetic
        return agreement.describe_step(
            jax.vmap(step, axis_name=od.REPLICA_AXIS), stacked, comm_state, stacked
        )


COMM = od.AxisComm(od.REPLICA_AXIS)
W = {"w": jnp.ones((4, 3))}


def test_same_configuration_same_description():
    make = lambda: od.diloco(optax.adam(1e-3), comm=COMM, period=4)  # noqa: E731
    assert agreement.differences([describe(make(), W), describe(make(), W)]) == []


def test_unpassed_options_describe_as_their_defaults():
    """streaming_diloco forwards outer_sync's options: leaving one out equals passing its default."""
    a = od.streaming_diloco(optax.sgd(0.1), comm=COMM, period=4, num_fragments=1)
    b = od.streaming_diloco(optax.sgd(0.1), comm=COMM, period=4, num_fragments=1, delay=0, blend=0.0)
    assert agreement.differences([describe(a, W), describe(b, W)]) == []


def _deep_composition(peak_lr):
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, 10, 100)
    inner = optax.chain(optax.clip(1.0), optax.adamw(schedule))
    return od.dynamic_loss_scale(od.diloco(inner, comm=COMM, period=4), comm=COMM)


@pytest.mark.parametrize(
    "a, b, expected",
    [
        (
            lambda: od.local_sgd(optax.sgd(0.1), comm=COMM, period=2),
            lambda: od.local_sgd(optax.sgd(0.1), comm=COMM, period=3),
            "local_sgd.period differs across processes: 2 on [0], 3 on [1]",
        ),
        (
            lambda: od.diloco(optax.adam(1e-3), comm=COMM, period=4),
            lambda: od.diloco(optax.adam(2e-3), comm=COMM, period=4),
            "diloco.inner.",  # the inner optimizer's hyperparameters, read from its closures
        ),
        (
            lambda: od.local_sgd(optax.sgd(optax.cosine_decay_schedule(0.1, 100)), comm=COMM, period=2),
            lambda: od.local_sgd(optax.sgd(optax.cosine_decay_schedule(0.1, 200)), comm=COMM, period=2),
            "schedule",  # schedules compare by their values at probe steps
        ),
        (
            lambda: _deep_composition(1e-3),
            lambda: _deep_composition(2e-3),
            "schedule",  # deep inside a composition
        ),
        (
            lambda: od.local_sgd(optax.sgd(lambda t: 0.1 * 0.99**t), comm=COMM, period=2),
            lambda: od.local_sgd(optax.sgd(lambda t: 0.1 * 0.98**t), comm=COMM, period=2),
            "schedule",  # a lambda learning rate, probed through optax's schedule wrapper
        ),
        (
            lambda: od.local_sgd(optax.sgd(0.1), comm=COMM, period=2),
            lambda: od.diloco(optax.sgd(0.1), comm=COMM, period=2),
            'transforms used differs across processes: ["local_sgd"] on [0], ["diloco"] on [1]',
        ),
    ],
)
def test_a_difference_is_named(a, b, expected):
    lines = agreement.differences([describe(a(), W), describe(b(), W)])
    assert lines and any(expected in line for line in lines), lines


def test_numpy_scalars_describe_like_python_numbers():
    a = od.local_sgd(optax.sgd(0.5), comm=COMM, period=2)
    b = od.local_sgd(optax.sgd(np.float32(0.5)), comm=COMM, period=2)
    assert agreement.differences([describe(a, W), describe(b, W)]) == []


def test_mismatch_raises_the_same_error_from_the_exchange():
    descriptions = [describe(od.local_sgd(optax.sgd(0.1), comm=COMM, period=p), W) for p in (2, 3)]
    texts = [json.dumps(d, sort_keys=True).encode() for d in descriptions]
    sent = []

    def exchange(mine):  # what an allgather returns to process 0 when process 1 runs period 3
        sent.append(len(mine))
        if len(mine) == agreement.DIGEST_BYTES:
            import hashlib

            return [hashlib.sha256(t).digest() for t in texts]
        return texts

    with pytest.raises(ValueError, match=r"local_sgd\.period differs across ranks: 2 on \[0\], 3 on \[1\]"):
        agreement.agree(descriptions[0], exchange, who="ranks")
    assert sent == [agreement.DIGEST_BYTES, len(texts[0])]


def test_agreement_ledger_in_one_process():
    mesh = jax.make_mesh((2,), (od.REPLICA_AXIS,), devices=jax.devices()[:2])
    step = od.on_mesh(lambda x: COMM.pmean(x), mesh)
    step(jnp.arange(2.0))
    assert od.comm_stats(step.agreement).bytes == 0  # one process: one configuration, nothing sent


def _check(results_dir, ranks, names):
    per_rank = [json.loads((results_dir / f"rank{r}.json").read_text()) for r in range(ranks)]
    for name in names:
        errors = [res[name]["error"] for res in per_rank]
        expected = per_rank[0][name]["expected"]
        for r, err in enumerate(errors):
            if expected is None:  # the control: the same configuration everywhere runs
                assert err is None, f"{name}: rank {r} raised {err!r}"
                continue
            assert err is not None and expected in err, f"{name}: rank {r} raised {err!r}"
            assert per_rank[r][name]["seconds"] < 30, (name, per_rank[r][name]["seconds"])
        if expected and "differs" in expected:
            assert len(set(errors)) == 1, f"{name}: the ranks raised different errors {errors}"


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def test_mismatch_matrix_under_mpirun(tmp_path):
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun), "-n", "2", sys.executable, str(WORKER), "mpi", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = list(json.loads((tmp_path / "rank0.json").read_text()))
    assert len(names) >= 19, names
    _check(tmp_path, 2, names)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_mismatch_subset_under_jax_distributed(tmp_path):
    port = str(_free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "multihost", str(tmp_path), str(i), "2", port],
            cwd=ROOT,
            env=dict(_env(), OPTAXDIST_AGREEMENT_CASES=",".join(CASES_ON_MULTIHOST)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    _check(tmp_path, 2, list(CASES_ON_MULTIHOST))
