#!/usr/bin/env bash
# One prepared GPU check for the Pallas kernels (< 8 minutes on an H200):
# install, run the kernel tests compiled on the GPU, run the kernel benchmarks.
#   benchmarks/device_check.sh OUTDIR
# Writes OUTDIR/{env.txt,pip.log,tests.log,junit.xml,bench.json,bench.log,summary.txt}.
set -uo pipefail

OUT="${1:?usage: benchmarks/device_check.sh OUTDIR}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
status=0

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1
} > "$OUT/env.txt"

"$PY" -m pip install --no-deps -e . > "$OUT/pip.log" 2>&1 || { echo "pip install failed"; status=1; }

# Compiled, not interpreted: the tests pick interpret mode only off GPU; force it off.
PALLAS_KERNELS_INTERPRET=0 timeout 300 "$PY" -m pytest -q tests/kernels \
  --junitxml="$OUT/junit.xml" -p no:cacheprovider > "$OUT/tests.log" 2>&1
tests_rc=$?
[ "$tests_rc" -eq 0 ] || status=1

timeout 150 "$PY" benchmarks/kernels.py --out "$OUT/bench.json" > "$OUT/bench.log" 2>&1
bench_rc=$?
[ "$bench_rc" -eq 0 ] || status=1

{
  echo "tests rc=$tests_rc: $(tail -n 1 "$OUT/tests.log")"
  echo "bench rc=$bench_rc"
} | tee "$OUT/summary.txt"
exit $status
