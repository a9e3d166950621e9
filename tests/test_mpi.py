"""Run every harness test under ``mpirun -n 2`` and ``-n 4``: one replica per process, MpiComm."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS_TEST_FILES = [
    "tests/test_comm.py",
    "tests/test_allreduce.py",
    "tests/test_loss_scale.py",
    "tests/test_compress.py",
    "tests/test_powersgd.py",
    "tests/test_local_sgd.py",
    "tests/test_partial.py",
    "tests/test_gossip.py",
    "tests/test_daso.py",
    "tests/test_exact_sync.py",
]


def _mpirun() -> str:
    found = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or shutil.which("mpirun")
    if found is None:
        raise RuntimeError("mpirun not found: install the 'mpich' wheel (optaxdist[mpi])")
    return found


# The files whose algorithms depend on the group beyond a pair (hierarchies, gossip topologies,
# DASO's nodes, fragments) run under 2 ranks by default and under 4 in the full run; the
# size-agnostic ones (compressors, PowerSGD, loss scaling; their collectives are the same psum and
# all-gather as above, and compressed reducers run in test_local_sgd) under 2 ranks in the full run
# only, which keeps the default run within its time budget.
GROUP_FILES = [
    "tests/test_comm.py",
    "tests/test_allreduce.py",
    "tests/test_local_sgd.py",
    "tests/test_partial.py",
    "tests/test_gossip.py",
    "tests/test_daso.py",
    "tests/test_exact_sync.py",
]
SIZE_AGNOSTIC_FILES = [f for f in HARNESS_TEST_FILES if f not in GROUP_FILES]


@pytest.mark.parametrize(
    "nproc, files",
    [
        pytest.param(2, GROUP_FILES, id="2"),
        pytest.param(2, SIZE_AGNOSTIC_FILES, id="2-size-agnostic", marks=pytest.mark.slow),
        pytest.param(4, GROUP_FILES, id="4", marks=pytest.mark.slow),
    ],
)
def test_harness_tests_under_mpirun(nproc, files, tmp_path, request):
    env = dict(
        os.environ,
        OPTAXDIST_MPI="1",
        OPTAXDIST_MPI_RESULTS=str(tmp_path),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    env.pop("XLA_FLAGS", None)  # one device per process
    cmd = [
        _mpirun(),
        "-n",
        str(nproc),
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-x",
        "-p",
        "no:cacheprovider",
        # the default run keeps the default selection under mpirun too; the full run runs all
        *(["-m", "not slow"] if request.node.get_closest_marker("slow") is None else []),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # every rank writes its own result (tests/conftest.py); each must have run tests and passed
    # them all (the ranks' terminal output interleaves, so it is not parsed)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == nproc, out[-6000:]
    assert all(r["exitstatus"] == 0 and r["passed"] > 0 and r["failed"] == 0 for r in results), results
