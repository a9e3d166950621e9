"""Every complete example in docs/ and examples/ runs: documentation is part of the feature.

A code block is *complete* when it starts with an import; shorter fragments (one-line ``tx = ...``
illustrations) are not run. Blocks and scripts meant for ``mpirun`` run under ``mpirun -n 2``.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _blocks():
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for i, code in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S)):
            first = next((ln for ln in code.splitlines() if ln.strip() and not ln.startswith("#")), "")
            if first.startswith(("import ", "from ")):
                yield pytest.param(code, id=f"{page.relative_to(ROOT)}[{i}]")


def _mpirun() -> str:
    return str(Path(sys.executable).parent / "mpirun")


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


# a block on several devices runs as a script of its own, as a reader would run it: it must ask for
# its CPU devices itself (``XLA_FLAGS``), not find the ones this process's conftest forced
ON_DEVICES = ("make_mesh", "mesh_hierarchy", "jax.devices()")


@pytest.mark.parametrize("code", list(_blocks()))
def test_doc_block_runs(code, tmp_path):
    mpi = "mpirun" in code or "MpiComm" in code or "mpi_hierarchy" in code
    if mpi or any(call in code for call in ON_DEVICES):
        script = tmp_path / "block.py"
        script.write_text(code)
        launcher = [_mpirun(), "-n", "2"] if mpi else []
        proc = subprocess.run(
            [*launcher, sys.executable, str(script)],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return
    with jax.numpy_dtype_promotion("standard"):  # users' code runs with JAX's default promotion
        exec(compile(code, "<doc block>", "exec"), {"__name__": "__doc_block__"})


# the examples that other tests run already (test_flax, test_checkpoint, test_exact_sync,
# test_multihost), or whose program a doc block runs (harnesses.md: the mesh, MPI and one process
# per node; loss_scale.md), are in the full run only; simulate_allreduce.py stands for them
COVERED_ELSEWHERE = {"linen_trainstate.py", "nnx_mnist.py", "multihost_checkpoint.py", "exact_sync.py"}
COVERED_ELSEWHERE |= {"multihost_allreduce.py", "mesh_allreduce.py", "mpi_allreduce.py", "loss_scale.py"}
COVERED_ELSEWHERE |= {"mpi_one_process_per_node.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in COVERED_ELSEWHERE else name
        for name in sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    ],
)
def test_example_script_runs(script):
    cmd = [sys.executable, f"examples/{script}"]
    if script.startswith("mpi_"):
        cmd = [_mpirun(), "-n", "2", *cmd]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
