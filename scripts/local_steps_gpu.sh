#!/usr/bin/env bash
# The local-steps rows on a GPU machine, as docs/benchmarks.md reports them:
#   1. every periodic transform at 512 simulated replicas, at each size in SIZES, with and without
#      the non-finite guard (one process per size: their timings);
#   2. each transform's peak GPU memory at 512 × the last size, in a process of its own (the
#      device's peak_bytes_in_use only grows over a process), several at once;
#   3. the 8-device CPU mesh of the same machine (JAX_PLATFORMS=cpu), at 100k parameters.
# MODEL=none (default) times the optimizer on given gradients, MODEL=mlp a training step
# (--local-model mlp). VARIANTS: the bench's --variants for steps 1 and 3 (default
# "default,nonfinite-ignore"; add "bare" to see what exact sync and the start check cost).
# MESH=0 leaves step 3 out. Every step is bounded in time and prints its wall seconds.
# Usage: [MODEL=mlp] [SIZES="10000 100000"] [VARIANTS=...] [MESH=0] bash scripts/local_steps_gpu.sh OUT_DIR
#        (with the project importable: PYTHONPATH=$PWD)
set -uo pipefail
out=${1:?usage: local_steps_gpu.sh OUT_DIR}
model=${MODEL:-none}
sizes=${SIZES:-10000 100000}
variants=${VARIANTS:-default,nonfinite-ignore}
mkdir -p "$out"
transforms=local_sgd,diloco,slowmo,streaming_diloco,daso,decentralized_sgd,sgp
bench=(python3 -m optaxdist.bench --suite overhead --rows local-steps --transforms "$transforms"
  --repeats 30 --donate --split-local-steps --local-model "$model" --quiet --no-plots)

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c "import jax, sys; print(sys.version.split()[0], jax.__version__, jax.devices())" | tee -a "$out/device.txt"

for size in $sizes; do
  start=$SECONDS
  timeout 300 "${bench[@]}" --harness simulate --replica-counts 512 --local-params "$size" \
    --variants "$variants" --out "$out/simulate512_$size" >"$out/simulate512_$size.log" 2>&1
  echo "simulate 512 × $size ($model): rc $?, $((SECONDS - start)) s"
done

start=$SECONDS
for t in ${transforms//,/ }; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m optaxdist.bench --suite overhead \
    --rows local-steps --transforms "$t" --repeats 3 --donate --split-local-steps --quiet --no-plots \
    --local-model "$model" --harness simulate --replica-counts 512 --local-params "${size:?}" \
    --variants default --out "$out/peak_$t" >"$out/peak_$t.log" 2>&1 &
done
wait
echo "peak memory runs ($model, 512 × $size): $((SECONDS - start)) s"

[ "${MESH:-1}" = 0 ] && exit 0
start=$SECONDS
JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8 timeout 150 "${bench[@]}" \
  --harness mesh --replica-counts 8 --local-params 100000 --variants "$variants" \
  --out "$out/mesh8_cpu" >"$out/mesh8_cpu.log" 2>&1
echo "mesh 8 (CPU, $model): rc $?, $((SECONDS - start)) s"
