#!/usr/bin/env bash
# The whole test suite: vmap, 8-device mesh, mpirun -n 2 / -n 4, and 2-process jax.distributed.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup_venv.sh
export PATH="$root/.venv/bin:$PATH"
ruff check optaxdist tests examples
ruff format --check optaxdist tests examples
exec python -m pytest -q "$@"
