#!/usr/bin/env bash
# The test suite: vmap, 8-device mesh, mpirun -n 2, and 2-process jax.distributed, within 15
# minutes on 2 cores. `--all` adds the cases marked slow (mpirun -n 4, the size-agnostic harness
# files under mpirun, every checkpointed algorithm under mpirun and jax.distributed, ...); other
# arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup_venv.sh
export PATH="$root/.venv/bin:$PATH"
ruff check optaxdist tests examples
ruff format --check optaxdist tests examples
# Two pytest workers (pytest-xdist): tracing and compiling are single-threaded, so one process
# leaves a core idle most of the time. OPTAXDIST_TEST_WORKERS=0 runs in this process instead.
workers=(-n "${OPTAXDIST_TEST_WORKERS:-2}" --dist worksteal)
if [[ "${1:-}" == "--all" ]]; then
  shift
  # the full run compiles with LLVM at XLA's default level, as users do (tests/conftest.py)
  export OPTAXDIST_TEST_OPT_LEVEL="${OPTAXDIST_TEST_OPT_LEVEL:-3}"
  exec python -m pytest -q "${workers[@]}" "$@"
fi
exec python -m pytest -q "${workers[@]}" -m "not slow" "$@"
