#!/usr/bin/env bash
# Create ./.venv with optaxdist and every extra (MPI, tests, benchmark). Idempotent: re-runs only
# when pyproject.toml changed. Needs only python3 (3.11+) with venv and a C compiler (for mpi4jax).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"
stamp="$venv/.optaxdist-installed"
want=$(sha256sum pyproject.toml scripts/setup_venv.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "[setup] creating $venv (first run takes a few minutes)" >&2
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q -e ".[test,bench]" setuptools wheel cython nanobind mpich "mpi4py>=4.0"
# mpi4jax builds from source against mpi4py and the mpich wheel's mpicc; CUDA_PATH keeps its build
# from taking /usr/local as the CUDA root on machines where nvcc is a wrapper there.
CUDA_PATH=${CUDA_PATH:-/usr/local/cuda} PATH="$venv/bin:$PATH" \
  "$py" -m pip install -q --no-build-isolation "mpi4jax>=0.8"
echo "$want" > "$stamp"
