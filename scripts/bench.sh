#!/usr/bin/env bash
# The benchmark's default suite (digits, 8 simulated replicas); extra arguments go to `optaxdist bench`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/setup_venv.sh
exec "$root/.venv/bin/optaxdist" bench "$@"
