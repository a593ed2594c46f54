#!/usr/bin/env bash
# One prepared GPU check for the Pallas kernels (< 8 minutes on an H200):
# install, run the kernel tests compiled on the GPU, run the kernel benchmarks.
#   benchmarks/device_check.sh OUTDIR
# Writes OUTDIR/{env.txt,pip.log,tests.log,junit.xml,bench.json,bench.log,summary.txt}.
# ALLOW_CPU=1 SKIP_INSTALL=1 dry-runs it on a CPU machine (kernels interpreted).
set -uo pipefail

OUT="${1:?usage: benchmarks/device_check.sh OUTDIR}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: we cd to the repo root next
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
status=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

# A CUDA-less jax would run everything interpreted and prove nothing about the GPU.
backend="$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)"
if [ "$backend" != "gpu" ] && [ "${ALLOW_CPU:-0}" != "1" ]; then
  echo "jax backend is '$backend', not gpu: stopping" | tee "$OUT/summary.txt"
  exit 1
fi

if [ "${SKIP_INSTALL:-0}" != "1" ]; then
  "$PY" -m pip install --no-deps -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; status=1; }
fi

# The tests run compiled (interpret=False) whenever the backend is a GPU.
timeout 300 "$PY" -m pytest -q tests/kernels --junitxml="$OUT/junit.xml" \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1
tests_rc=$?
[ "$tests_rc" -eq 0 ] || status=1

timeout 150 "$PY" benchmarks/kernels.py --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
[ "$bench_rc" -eq 0 ] || status=1

{
  echo "backend=$backend tests rc=$tests_rc: $(tail -n 1 "$OUT/tests.log")"
  echo "bench rc=$bench_rc"
} | tee "$OUT/summary.txt"
exit $status
