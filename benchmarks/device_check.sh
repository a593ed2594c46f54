#!/usr/bin/env bash
# The kernel test sweep compiled on a GPU, a second check after benchmarks/device_probe.py
# (whose `check` stage compares each kernel with its reference on the device).
#   benchmarks/device_check.sh OUTDIR   -> OUTDIR/{env.txt,tests.log,junit.xml,summary.txt}
# Nothing is installed (PYTHONPATH is the repo root); it needs pytest, which the probe
# does not. JAX_PLATFORMS=cuda keeps tests/conftest.py from choosing the CPU.
# ALLOW_CPU=1 dry-runs it on a CPU machine (kernels interpreted).
set -uo pipefail

OUT="${1:?usage: benchmarks/device_check.sh OUTDIR}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: we cd to the repo root next
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${ALLOW_CPU:-0}" = "1" ]; then
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
else
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
fi

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 || true
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if ! "$PY" -c 'import pytest' 2>/dev/null; then
  echo "pytest is not installed: run benchmarks/device_probe.py instead" | tee "$OUT/summary.txt"
  exit 1
fi

# The tests run compiled (interpret=False) whenever the backend is a GPU.
timeout 300 "$PY" -m pytest -q tests/kernels --junitxml="$OUT/junit.xml" \
  -p no:cacheprovider > "$OUT/tests.log" 2>&1
tests_rc=$?
echo "JAX_PLATFORMS=$JAX_PLATFORMS tests rc=$tests_rc: $(tail -n 1 "$OUT/tests.log")" \
  | tee "$OUT/summary.txt"
exit $tests_rc
