"""Run every harness test under ``mpirun -n 2`` and ``-n 4``: one replica per process (MpiComm), and
one process per node of 4 devices (node_hierarchy, on_node)."""

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
# the default run under 2 ranks leaves out partial averaging (the periodic engine runs in
# test_local_sgd), DASO and the exact-sync property (both run under the one-process-per-node case
# below); the full run has them under 2 ranks too ("2-more")
GROUP_MORE_FILES = ["tests/test_partial.py", "tests/test_daso.py", "tests/test_exact_sync.py"]
GROUP_DEFAULT_FILES = [f for f in GROUP_FILES if f not in GROUP_MORE_FILES]
SIZE_AGNOSTIC_FILES = [f for f in HARNESS_TEST_FILES if f not in GROUP_FILES]
# One process per node (2 processes × 4 CPU devices, node_hierarchy/on_node): the default run keeps
# the communicator's own tests (every collective over the devices of both nodes, through the node
# and MPI), DASO with Heat's groups and the engine's property test; the full run adds the other
# harness files (the all-reduce family first), in their default selection (the whole of them takes
# over 25 minutes on 2 cores: 8 device threads and two compilers).
NODE_FILES = [
    "tests/test_comm.py",
    "tests/test_daso.py",
    "tests/test_exact_sync.py",
]
NODE_MORE_FILES = [f for f in HARNESS_TEST_FILES if f not in NODE_FILES]


@pytest.mark.parametrize(
    "nproc, node_devices, files",
    [
        pytest.param(2, 0, GROUP_DEFAULT_FILES, id="2"),
        pytest.param(2, 0, GROUP_MORE_FILES, id="2-more", marks=pytest.mark.slow),
        pytest.param(2, 0, SIZE_AGNOSTIC_FILES, id="2-size-agnostic", marks=pytest.mark.slow),
        pytest.param(4, 0, GROUP_FILES, id="4", marks=pytest.mark.slow),
        pytest.param(2, 4, NODE_FILES, id="2-nodes-x4"),
        pytest.param(2, 4, NODE_MORE_FILES, id="2-nodes-x4-more", marks=pytest.mark.slow),
    ],
)
def test_harness_tests_under_mpirun(nproc, node_devices, files, tmp_path, request):
    env = dict(
        os.environ,
        OPTAXDIST_MPI="1",
        OPTAXDIST_MPI_RESULTS=str(tmp_path),
        OPTAXDIST_NODE_DEVICES=str(node_devices),
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
    )
    env.pop("XLA_FLAGS", None)  # one device per process, or OPTAXDIST_NODE_DEVICES (conftest.py)
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
        *(["-m", "not slow"] if request.node.get_closest_marker("slow") is None or node_devices else []),
        *files,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    # every rank writes its own result (tests/conftest.py); each must have run tests and passed
    # them all (the ranks' terminal output interleaves, so it is not parsed)
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert len(results) == nproc, out[-6000:]
    assert all(r["exitstatus"] == 0 and r["passed"] > 0 and r["failed"] == 0 for r in results), results
