"""benchmarks/soak.py shortened to about a minute (the documented run is 10): a real
`qwen-jax serve` subprocess at twice its measured capacity with the whole mix (streams,
chats, stop strings, n=2, logprobs, disconnecting clients, hostile bodies) passes every
check: each request ended, no page leaked, RSS flat, the greedy answer unchanged, a clean
drain."""

import json
import os
import pathlib
import subprocess
import sys

from tests.server.conftest import ENGINE_ARGS

SOAK = pathlib.Path(__file__).parents[2] / "benchmarks" / "soak.py"


def test_short_soak_passes_every_check(tmp_path, tiny_model_dir, compile_cache):
    out = tmp_path / "soak.json"
    buckets = ",".join(map(str, ENGINE_ARGS["token_buckets"]))
    seqs = ",".join(map(str, ENGINE_ARGS["seq_buckets"]))
    cmd = [sys.executable, str(SOAK), "--model", str(tiny_model_dir), "--load-format", "dummy",
           "--duration", "30", "--capacity-seconds", "8", "--sample-interval", "2",
           "--request-timeout", "60", "--max-prompt-words", "20", "--max-output-tokens", "24",
           "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "128",
           "--max-waiting", "8", "--token-buckets", buckets, "--seq-buckets", seqs,
           "--compilation-cache-dir", compile_cache, "--out", str(out)]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env,
                          cwd=SOAK.parents[1])
    report = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, (proc.stderr[-3000:], report.get("checks"),
                                  report.get("failures"), report.get("rss"))
    assert all(report["checks"].values()), report["checks"]
    outcomes, features = report["outcomes"], report["features"]
    assert outcomes["completed"] > 20 and outcomes.get("rejected", 0) >= 1
    assert outcomes.get("disconnected", 0) >= 1
    assert all(features[k] >= 1 for k in ("stream", "chat", "stop", "n2", "logprobs"))
    assert report["arrival_rate_req_per_s"] > report["capacity_req_per_s"]
    assert len(report["samples"]) >= 10 and all(s["rss_mb"] for s in report["samples"])
