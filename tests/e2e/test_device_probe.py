"""benchmarks/device_probe.py dry run (--small: the tiny model on the CPU, kernels
interpreted): every stage leaves its figures as JSON lines, in order, and a stage past its
timeout leaves one line saying so while the next stage still runs."""

import json
import os
import pathlib
import subprocess
import sys

from tests.helpers.xla_flags import compile_speed_flags

PROBE = pathlib.Path(__file__).parents[2] / "benchmarks" / "device_probe.py"
STAGES = ["env", "check", "attention", "matmul", "engine", "offline", "kernel_table",
          "done"]


def run_probe(out, *args):
    # One device, as on a GPU machine; the tests' compile-speed flags (the figures of a
    # dry run are not asserted on).
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(compile_speed_flags())}
    env.pop("PYTHONPATH", None)  # the probe needs no install and no PYTHONPATH
    proc = subprocess.run([sys.executable, str(PROBE), "--small", "--out", str(out), *args],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (out / "probe.jsonl").read_text().splitlines()
    assert proc.stdout.splitlines() == lines  # printed as written
    return [json.loads(line) for line in lines]


def test_dry_run_reports_every_stage_in_order(tmp_path):
    rows = run_probe(tmp_path)
    stages = [r["stage"] for r in rows]
    assert list(dict.fromkeys(stages)) == STAGES
    assert stages == sorted(stages, key=STAGES.index), "stages ran out of order"
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)
    assert not [r for r in rows if "error" in r]
    by = lambda stage: [r for r in rows if r["stage"] == stage]
    assert by("env")[0]["backend"] == "cpu" and by("env")[0]["cuda_lowering"] == "ok"
    conditional = by("env")[1]
    assert conditional["part"] == "conditional" and conditional["busy_ms"] > 0
    assert conditional["call_returns_ms"] >= 0 and conditional["select_call_returns_ms"] >= 0
    assert "per_cond_us" in conditional
    checks = by("check")
    assert len(checks) == 5 and all(c["ok"] for c in checks)
    assert {r["name"] for r in by("attention")} == {"decode_s1_ctx64", "decode_s4_ctx64",
                                                    "prefill_32"}
    assert {r["part"] for r in by("matmul")} == {"grouped_matmul", "stacked_matmul", "kv_write"}
    # every candidate of the prefill attention and of the bf16 grouped matmul is timed
    assert {r["impl"] for r in by("attention") if r["name"] == "prefill_32"} == {
        "pallas", "mosaic"}
    assert {r["impl"] for r in by("matmul") if r.get("format") == "bf16"} == {"pallas", "xla"}
    table = by("kernel_table")[0]["table"]
    assert json.loads((tmp_path / "kernel_table.json").read_text()) == table
    assert set(table) == {"grouped_matmul", "ragged_paged_attention"}
    assert set(table["ragged_paged_attention"]) == {"1", "4", "32"}
    engine = by("engine")
    assert engine[0]["load_s"] >= 0 and len(engine[0]["buckets"]) == 4
    compiled = [r for r in engine if "bucket" in r]
    assert sorted(map(tuple, (r["bucket"] for r in compiled))) == [(8, 4), (8, 8), (64, 4), (64, 8)]
    assert all(r["compile_s"] > 0 and r["ops"]["fusions"] > 0 for r in compiled)
    offline = by("offline")
    # Each concurrency through the overlapped loop, then the serial one (issue 14's
    # serial-against-overlapped figures): the same steps, overlapped only in the first.
    # Then the overlapped loop again with Qwen3's recommended sampling.
    runs = [(loop, "greedy") for loop in ("overlapped", "overlapped-engine-thread", "serial")]
    runs.append(("overlapped", "qwen3"))
    assert [(r["concurrency"], r["loop"], r["sampling"]) for r in offline] == [
        (c, loop, sampling) for c in (1, 8) for loop, sampling in runs]
    assert all(r["output_tok_s"] > 0 and r["decode_steps"] > 0 for r in offline)
    assert all(r["dispatch_ms_p50"] > 0 for r in offline)
    sampled = [r for r in offline if r["sampling"] == "qwen3"]
    assert all(r["overlapped_steps"] > 0 and r["decode_execute_over_greedy"] > 0
               for r in sampled)
    greedy = [r for r in offline if r["sampling"] == "greedy"]
    for overlapped, engine_thread, serial in zip(*(greedy[i::3] for i in range(3))):
        assert overlapped["overlapped_steps"] > 0 and engine_thread["overlapped_steps"] > 0
        assert serial["overlapped_steps"] == 0 and serial["serial_over_overlapped"] > 0
        # a CPU's calls return at once: no dispatch thread by default
        assert not overlapped["dispatch_thread"] and not engine_thread["dispatch_thread"]
    # Step FLOP/s and bytes/s from the step shapes; a CPU has no peak, so no MFU / MBU.
    assert all(r["decode_gb_s_p50"] > 0 and r["prefill_tflop_s_p50"] > 0 for r in offline)
    assert all(r["peak"] is None and "decode_mbu_p50" not in r for r in offline)


def test_a_stage_past_its_timeout_leaves_one_line_and_the_next_stage_runs(tmp_path):
    rows = run_probe(tmp_path, "--stages", "env,check,attention", "--timeout", "check=0.5")
    assert [{k: v for k, v in r.items() if k != "t"} for r in rows if r["stage"] == "check"] == [
        {"stage": "check", "error": "timeout", "timeout_s": 0.5}]
    assert len([r for r in rows if r["stage"] == "attention"]) == 4  # 2 decodes, 2 prefills
    assert rows[-1]["stage"] == "done"


def test_dry_run_with_quantised_weights_and_formats_of_the_grouped_matmul(tmp_path):
    rows = run_probe(tmp_path, "--stages", "matmul,engine,offline", "--quantization", "fp8",
                     "--concurrency", "1", "--loops", "overlapped", "--sampled-loops", "")
    assert not [r for r in rows if "error" in r]
    grouped = [r for r in rows if r.get("part") == "grouped_matmul" and r["impl"] == "pallas"]
    decode = {r["format"] for r in grouped if "decode" in r["name"]}
    assert decode == {"bf16", "fp8", "int4"}
    for row in grouped:
        if row["format"] != "bf16":
            assert row["rel_err"] < 2e-2 and row["vs_bf16"] > 0
    engine = [r for r in rows if r["stage"] == "engine"][0]
    assert engine["quantization"] == "fp8" and engine["weight_gb"] > 0
    offline = [(r["quantization"], r["loop"]) for r in rows if r["stage"] == "offline"]
    assert offline == [("fp8", "overlapped")]


def test_dry_run_of_the_lora_stage(tmp_path):
    # When asked: decode with no adapter, then 8 adapters mixed, in one engine.
    rows = [r for r in run_probe(tmp_path, "--stages", "lora") if r["stage"] == "lora"]
    assert [(r["batch"], r["adapters"]) for r in rows] == [(8, "none"), (8, "mixed_8")]
    assert all(r["output_tok_s"] > 0 and r["mixed_over_none"] > 0 for r in rows)
