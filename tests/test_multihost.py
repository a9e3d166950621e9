"""The multi-host path: 2 ``jax.distributed`` processes on loopback (gloo CPU collectives)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax

import optaxdist as od
from tests.harness import VmapHarness
from tests.test_allreduce import run_trajectory

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_mesh_matches_simulation(tmp_path):
    port, nproc = _free_port(), 2
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.multihost_worker",
                str(i),
                str(nproc),
                str(port),
                str(tmp_path / f"out{i}.npz"),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(nproc)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=300)
            logs.append(out)
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)

    results = [np.load(tmp_path / f"out{i}.npz") for i in range(nproc)]
    n = int(results[0]["n"])
    assert n == 4
    ref, ref_state = run_trajectory(
        VmapHarness(n), lambda c: optax.chain(od.allreduce(comm=c), optax.sgd(0.1, momentum=0.9))
    )
    seen = set()
    for r in results:
        for j, row in enumerate(r["rows"]):
            np.testing.assert_allclose(r["w"][j], ref["w"][row], atol=1e-6, rtol=0)
            np.testing.assert_allclose(r["b"][j], ref["b"][row], atol=1e-6, rtol=0)
            seen.add(int(row))
        assert int(r["bytes"]) == int(r["global_bytes"]) == od.comm_stats(ref_state).bytes
    assert seen == set(range(n))
