#!/usr/bin/env bash
# One prepared end-to-end serving benchmark (< 8 minutes on an H200): serve Qwen3-30B-A3B
# shapes with dummy bf16 weights, then `qwen-jax bench serve` random 1024 in / 128 out at
# max-concurrency 1 (batch-1 decode), 8 and 64; compare with the batch-1 roofline and
# vLLM's published H100 figures.
#   benchmarks/device_e2e.sh OUTDIR
# Writes OUTDIR/{env.txt,server.log,health.txt,bench_c<C>.{json,log},metrics.txt,
#                summary.json,summary.txt}.
# Run from anywhere with the repo's own checkout (PYTHONPATH is set, nothing installed).
# DRY_RUN=1 runs it on a CPU with a tiny dummy model and small lengths. SERVER_CMD="..." benchmarks another server listening on
# $PORT instead (e.g. vLLM on the same GPU, for a side-by-side).
set -uo pipefail

OUT="${1:?usage: benchmarks/device_e2e.sh OUTDIR}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"  # absolute: we cd to the repo root next
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python || command -v python3)}"
PORT="${PORT:-8031}"
URL="http://127.0.0.1:$PORT"
DRY_RUN="${DRY_RUN:-0}"
status=0

if [ "$DRY_RUN" = "1" ]; then
  # A tiny Qwen3-MoE config; weights come from --load-format dummy.
  mkdir -p "$OUT/tiny-model"
  cat > "$OUT/tiny-model/config.json" <<'EOF'
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1024,
 "hidden_size": 32, "intermediate_size": 40, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
 "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
 "eos_token_id": 1, "bos_token_id": 0, "num_experts": 4, "num_experts_per_tok": 2,
 "moe_intermediate_size": 16, "decoder_sparse_step": 1, "mlp_only_layers": [],
 "norm_topk_prob": true, "tie_word_embeddings": false, "torch_dtype": "float32"}
EOF
  MODEL="${MODEL:-$OUT/tiny-model}"; DTYPE="${DTYPE:-float32}"
  INPUT_LEN="${INPUT_LEN:-32}"; OUTPUT_LEN="${OUTPUT_LEN:-8}"; VOCAB_IDS="${VOCAB_IDS:-1000}"
  CONCURRENCIES="${CONCURRENCIES:-1 2 4}"; PROMPTS_PER_SLOT="${PROMPTS_PER_SLOT:-2}"
  ENGINE_ARGS="${ENGINE_ARGS:---max-model-len 64 --max-num-seqs 4 --max-num-batched-tokens 64 --token-buckets 8,64 --seq-buckets 4}"
  HEALTH_WAIT="${HEALTH_WAIT:-300}"; BENCH_TIMEOUT="${BENCH_TIMEOUT:-120}"; MAX_PROMPTS="${MAX_PROMPTS:-16}"
else
  MODEL="${MODEL:-qwen3-30b-a3b}"; DTYPE="${DTYPE:-bfloat16}"
  INPUT_LEN="${INPUT_LEN:-1024}"; OUTPUT_LEN="${OUTPUT_LEN:-128}"; VOCAB_IDS="${VOCAB_IDS:-150000}"
  CONCURRENCIES="${CONCURRENCIES:-1 8 64}"; PROMPTS_PER_SLOT="${PROMPTS_PER_SLOT:-3}"
  # 1,152 tokens per request fit in 1,280; a 2,048-token budget prefills a prompt in one
  # step; few buckets keep the compile inside the time box (decode at c=1 pads to S=8).
  ENGINE_ARGS="${ENGINE_ARGS:---max-model-len 1280 --max-num-seqs 64 --max-num-batched-tokens 2048 --token-buckets 8,64,2048 --seq-buckets 8,64 --gpu-memory-utilization 0.9}"
  HEALTH_WAIT="${HEALTH_WAIT:-240}"; BENCH_TIMEOUT="${BENCH_TIMEOUT:-100}"; MAX_PROMPTS="${MAX_PROMPTS:-128}"
fi

{
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  else
    echo "no nvidia-smi"
  fi
  "$PY" -c 'import jax; print("jax", jax.__version__, jax.default_backend(), jax.devices())' 2>&1
  echo "model=$MODEL dtype=$DTYPE in=$INPUT_LEN out=$OUTPUT_LEN c=[$CONCURRENCIES] $ENGINE_ARGS"
} > "$OUT/env.txt"
cat "$OUT/env.txt"

backend="$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)"
if [ "$backend" != "gpu" ] && [ "$DRY_RUN" != "1" ] && [ -z "${SERVER_CMD:-}" ]; then
  echo "jax backend is '$backend', not gpu: stopping (DRY_RUN=1 for a CPU dry run)" \
    | tee "$OUT/summary.txt"
  exit 1
fi

# Nothing is installed: the GPU image has the dependencies but no network, and an editable
# install would fetch setuptools for its isolated build. The repo root goes on the path.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# ---- server ----------------------------------------------------------------------------
if [ -n "${SERVER_CMD:-}" ]; then
  bash -c "exec $SERVER_CMD" > "$OUT/server.log" 2>&1 &
else
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of flags
  "$PY" -m serving.cli.main serve --model "$MODEL" --load-format dummy --dtype "$DTYPE" \
    --host 127.0.0.1 --port "$PORT" $ENGINE_ARGS > "$OUT/server.log" 2>&1 &
fi
server_pid=$!
stop_server() {
  kill -TERM "$server_pid" 2>/dev/null && { timeout 30 tail --pid="$server_pid" -f /dev/null || kill -KILL "$server_pid"; }
}
trap stop_server EXIT

http_get() {  # URL -> body on stdout; fails unless 200
  "$PY" -c 'import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1], timeout=5).read().decode())' "$1" 2>/dev/null
}

started=$(date +%s)
healthy=0
while [ $(( $(date +%s) - started )) -lt "$HEALTH_WAIT" ]; do
  if http_get "$URL/health" > /dev/null; then healthy=1; break; fi
  kill -0 "$server_pid" 2>/dev/null || break
  sleep 2
done
echo "healthy=$healthy after $(( $(date +%s) - started )) s" | tee "$OUT/health.txt"
if [ "$healthy" != "1" ]; then
  tail -n 40 "$OUT/server.log"
  echo "server did not become healthy in ${HEALTH_WAIT}s" | tee "$OUT/summary.txt"
  exit 1
fi

# ---- benchmarks ------------------------------------------------------------------------
for c in $CONCURRENCIES; do
  n=$(( c * PROMPTS_PER_SLOT )); [ "$n" -lt 8 ] && n=8; [ "$n" -gt "$MAX_PROMPTS" ] && n=$MAX_PROMPTS
  limit=$BENCH_TIMEOUT; [ "$c" -eq 1 ] && limit=$(( BENCH_TIMEOUT * 2 / 3 ))
  timeout "$limit" "$PY" -m serving.cli.main bench serve --base-url "$URL" \
    --endpoint /v1/completions --dataset random --token-ids --random-vocab-size "$VOCAB_IDS" \
    --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --ignore-eos \
    --num-prompts "$n" --max-concurrency "$c" --request-rate inf --seed "$c" \
    --metric-percentiles 50,90,99 --result-json "$OUT/bench_c$c.json" \
    > "$OUT/bench_c$c.log" 2>&1
  rc=$?
  echo "bench c=$c n=$n rc=$rc"
  [ "$rc" -eq 0 ] || { status=1; tail -n 5 "$OUT/bench_c$c.log"; }
done
http_get "$URL/metrics" > "$OUT/metrics.txt" || true

# ---- summary ---------------------------------------------------------------------------
"$PY" - "$OUT" "$CONCURRENCIES" "$DRY_RUN" <<'EOF' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out, concurrencies = Path(sys.argv[1]), [int(c) for c in sys.argv[2].split()]
if sys.argv[3] == "1":
    print("DRY RUN (tiny model, CPU): the H200/H100 references below do not apply")
# Batch-1 roofline: HBM bytes of the active params per token on an H200; vLLM: H100, same
# model, random 1024 in / 128 out, output tok/s at max-concurrency 8 and 64.
reference = {1: ("roofline (H200, batch 1)", 789.0), 8: ("vLLM H100", 611.0),
             64: ("vLLM H100", 2164.0)}
rows = {}
for c in concurrencies:
    path = out / f"bench_c{c}.json"
    if not path.exists():
        rows[c] = {"error": "no result"}
        continue
    r = json.loads(path.read_text())
    row = {"completed": r["completed"], "failed": r["failed"],
           "output_tok_s": r["output_throughput"], "request_s": r["request_throughput"],
           "mean_ttft_ms": r["mean_ttft_ms"], "p99_ttft_ms": r["p99_ttft_ms"],
           "mean_tpot_ms": r["mean_tpot_ms"], "p99_itl_ms": r["p99_itl_ms"],
           # Decode speed of one stream: 1 / TPOT, prefill excluded.
           "decode_tok_s_per_stream": 1000.0 / r["mean_tpot_ms"] if r["mean_tpot_ms"] else None}
    if c in reference:
        name, value = reference[c]
        ours = row["decode_tok_s_per_stream"] if c == 1 else row["output_tok_s"]
        row["reference"] = {"name": name, "tok_s": value,
                            "ratio": ours / value if ours else None}
    rows[c] = row
(out / "summary.json").write_text(json.dumps(rows, indent=2))
for c, row in rows.items():
    if "error" in row:
        print(f"c={c}: {row['error']}")
        continue
    line = (f"c={c:<3} output {row['output_tok_s']:9.1f} tok/s  TTFT mean {row['mean_ttft_ms']:8.1f}"
            f" ms  TPOT {row['mean_tpot_ms']:7.2f} ms  ({row['completed']} ok, {row['failed']} failed)")
    if "reference" in row:
        ref = row["reference"]
        what = "batch-1 decode" if c == 1 else "output"
        line += (f"\n       {what} vs {ref['name']} {ref['tok_s']:.0f} tok/s: "
                 f"{ref['ratio']:.2f}x" if ref["ratio"] else "")
    print(line)
EOF
[ -s "$OUT/summary.json" ] || status=1
exit $status
