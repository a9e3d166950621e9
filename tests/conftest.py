"""Test configuration shared by the three harnesses.

Normal runs force 8 CPU devices (for the mesh harness) and parametrize every test that takes the
``harness`` fixture over ``vmap`` and ``mesh``. Under ``mpirun`` (``OPTAXDIST_MPI=1``, set by
tests/test_mpi.py) only the ``harness`` tests are collected: each process keeps one device and they
run on the ``mpi`` harness, or, with ``OPTAXDIST_NODE_DEVICES=G``, each process is a node of ``G``
devices and they run on the ``node`` harness (one process per node).
"""

import json
import os
from pathlib import Path

UNDER_MPI = os.environ.get("OPTAXDIST_MPI") == "1"
# one process per node: under mpirun, each process with OPTAXDIST_NODE_DEVICES CPU devices
NODE_DEVICES = int(os.environ.get("OPTAXDIST_NODE_DEVICES", "0"))
# Compiling is most of the suite's time, and LLVM's optimizations most of an XLA:CPU compile: the
# test processes (these, and pytest under mpirun) compile with LLVM at OPTAXDIST_TEST_OPT_LEVEL,
# 0 unless set (`scripts/test.sh --all` sets 3, XLA's default). At 0 the default run took 736 s
# on 2 cores, against 919 s at 3, every test passing both ways; the HLO XLA compiles (fusion,
# layout, collectives) was the same at both (DASO's sync program and its hand-written one). An
# XLA_FLAGS that sets the level wins. Scripts the tests start as a user would (doc blocks,
# examples, workers) and `scripts/bench.sh` compile at XLA's default.
OPT_LEVEL = os.environ.get("OPTAXDIST_TEST_OPT_LEVEL", "0")
TEST_XLA_FLAGS = {"xla_backend_optimization_level": f"--xla_backend_optimization_level={OPT_LEVEL}"}
if not UNDER_MPI or NODE_DEVICES:
    TEST_XLA_FLAGS["xla_force_host_platform_device_count"] = (
        f"--xla_force_host_platform_device_count={NODE_DEVICES or 8}"
    )
_caller = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join(  # a flag the caller set wins
    [_caller, *(flag for name, flag in TEST_XLA_FLAGS.items() if name not in _caller)]
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

from tests.harness import MeshHarness, MpiHarness, NodeHarness, VmapHarness  # noqa: E402

HARNESS_N = 8
# where ``@pytest.mark.sample`` thins a test out by default: vmap is the reference every harness is
# compared with, and the one-process-per-node runs (tests/test_mpi.py) keep their whole selection
SAMPLED_HARNESSES = ("mesh", "mpi")


# The cases that start other processes (mpirun, jax.distributed) run for minutes: they go first, so
# that under pytest-xdist one of them does not end the run alone on one worker.
FIRST = ("tests/test_mpi.py", "tests/test_multihost.py", "tests/test_node_faults.py")


def pytest_generate_tests(metafunc):
    if "harness" in metafunc.fixturenames:
        kinds = (["node"] if NODE_DEVICES else ["mpi"]) if UNDER_MPI else ["vmap", "mesh"]
        if metafunc.definition.get_closest_marker("against_vmap"):  # vmap against itself proves nothing
            kinds = [k for k in kinds if k != "vmap"]
        metafunc.parametrize("harness", kinds, indirect=True)


@pytest.fixture
def harness(request):
    if request.param == "vmap":
        return VmapHarness(HARNESS_N)
    if request.param == "mesh":
        return MeshHarness(HARNESS_N)
    if request.param == "node":
        return NodeHarness()
    return MpiHarness()


def pytest_sessionfinish(session, exitstatus):
    """Under mpirun, each rank writes its result to $OPTAXDIST_MPI_RESULTS/rank<r>.json (read by
    tests/test_mpi.py: the ranks' terminal output interleaves)."""
    out = os.environ.get("OPTAXDIST_MPI_RESULTS")
    if not (UNDER_MPI and out):
        return
    from mpi4py import MPI

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    result = {
        "exitstatus": int(exitstatus),
        "passed": len(stats.get("passed", [])),
        "failed": len(stats.get("failed", [])) + len(stats.get("error", [])),
    }
    Path(out, f"rank{MPI.COMM_WORLD.Get_rank()}.json").write_text(json.dumps(result))


@pytest.hookimpl(tryfirst=True)  # before ``-m "not slow"`` deselects
def pytest_collection_modifyitems(config, items):
    # ``@pytest.mark.sample(*cases, harnesses=...)``: on these harnesses (by default the mesh and
    # mpirun's one process per replica), only these cases run by default, named by their ``name``
    # parameter or by their id without the harness's; the others are marked slow (the full run has
    # them). On the other harnesses the marker changes nothing.
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for sample in item.iter_markers("sample"):
            harness = params.get("harness")
            if harness not in sample.kwargs.get("harnesses", SAMPLED_HARNESSES):
                continue
            ids = item.callspec.id.split("-")
            ids.remove(harness)
            if params.get("name") not in sample.args and "-".join(ids) not in sample.args:
                item.add_marker(pytest.mark.slow)
    if not UNDER_MPI:
        items.sort(key=lambda item: not item.nodeid.startswith(FIRST))
        return
    keep = [it for it in items if "harness" in getattr(it, "fixturenames", ())]
    dropped = [it for it in items if it not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
