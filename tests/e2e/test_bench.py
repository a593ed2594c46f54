"""`qwen-jax bench serve` against a fake OpenAI-compatible server (and the real one when
it is there); the metric definitions on synthetic data."""

import json

import numpy as np
import pytest

from serving.bench.report import RequestResult, compute_metrics, format_table, parse_goodput
from serving.cli.main import main
from tests.helpers.fake_openai import serve_in_thread

OUTPUT_LEN = 5
METRICS = ("ttft", "tpot", "itl", "e2el")


def _bench(tmp_path, url, *extra) -> dict:
    out = tmp_path / "result.json"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "6",
               "--random-input-len", "12", "--random-output-len", str(OUTPUT_LEN),
               "--result-json", str(out), *extra])
    report = json.loads(out.read_text())
    report["rc"] = rc
    return report


def _assert_all_metrics(report):
    for name in METRICS:
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{name}_ms" in report, f"{stat}_{name}_ms missing"
        assert report[f"mean_{name}_ms"] > 0, name
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert report[key] > 0, key


def test_bench_serve_against_fake_server_produces_all_metrics(tmp_path, fake_server):
    url, state = fake_server
    report = _bench(tmp_path, url, "--max-concurrency", "2", "--goodput", "ttft:10000",
                    "tpot:10000", "--save-detailed")
    assert report["rc"] == 0 and report["completed"] == 6 and report["failed"] == 0
    _assert_all_metrics(report)
    assert report["total_output_tokens"] == 6 * OUTPUT_LEN  # from usage
    assert report["total_input_tokens"] == 6 * 7  # the server's prompt_tokens win
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert state.max_active <= 2
    assert all(len(itl) == OUTPUT_LEN - 1 for itl in report["itls"])
    body = state.bodies[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}


def test_bench_serve_reports_the_runs_mean_acceptance_length(tmp_path, fake_server, capsys):
    url, state = fake_server
    state.metrics = True
    report = _bench(tmp_path, url)
    assert report["completed"] == 6
    # the run's 6 requests (not the warm-up's): 2 drafts and 3 of 6 draft tokens kept each
    assert report["spec_decode_num_drafts"] == 12
    assert report["spec_decode_num_accepted_tokens"] == 18
    assert report["spec_decode_mean_acceptance_length"] == pytest.approx(2.5)
    assert report["spec_decode_acceptance_rate"] == pytest.approx(0.5)
    printed = capsys.readouterr().out
    assert "Acceptance length:" in printed and "2.50" in printed


def test_bench_serve_chat_endpoint_shared_prefix(tmp_path, fake_server):
    url, state = fake_server
    report = _bench(tmp_path, url, "--endpoint", "/v1/chat/completions", "--dataset",
                    "shared-prefix", "--shared-prefix-len", "20", "--num-prefix-groups", "2",
                    "--suffix-len", "4", "--request-rate", "200", "--burstiness", "0.5")
    assert report["completed"] == 6
    _assert_all_metrics(report)
    systems = {b["messages"][0]["content"] for b in state.bodies if b["messages"][0]["role"]
               == "system"}
    assert len(systems) == 2  # two prefix groups, each a shared system prompt
    assert all(b["max_completion_tokens"] == OUTPUT_LEN for b in state.bodies)


def test_bench_serve_token_id_prompts_have_exact_lengths(tmp_path, fake_server):
    url, state = fake_server
    report = _bench(tmp_path, url, "--dataset", "shared-prefix", "--token-ids",
                    "--shared-prefix-len", "20", "--num-prefix-groups", "2", "--suffix-len", "4",
                    "--no-warmup")
    assert report["completed"] == 6
    prompts = [b["prompt"] for b in state.bodies]
    assert all(len(p) == 24 and all(isinstance(t, int) for t in p) for p in prompts)
    assert len({tuple(p[:20]) for p in prompts}) == 2


def test_bench_serve_counts_failed_requests_without_crashing(tmp_path, fake_server):
    url, _ = fake_server
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p}) for p in
                              ["hello there", "FAIL please", "good day", "FAIL again"]) + "\n")
    report = _bench(tmp_path, url, "--dataset", "jsonl", "--dataset-path", str(data))
    assert report["rc"] == 0
    assert report["completed"] == 2 and report["failed"] == 2
    assert all(e.startswith("HTTP 500") for e in report["errors"])


def test_bench_serve_without_usage_counts_chunks(tmp_path, fake_server):
    url, state = fake_server
    state.send_usage = False
    report = _bench(tmp_path, url, "--no-warmup")
    assert report["total_output_tokens"] == 6 * OUTPUT_LEN


def test_bench_serve_unreachable_server_fails_fast(tmp_path):
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "2",
               "--random-input-len", "4", "--random-output-len", "2"])
    assert rc == 2


def test_bench_serve_against_the_real_server(tmp_path, tokenizer_ckpt, compile_cache):
    from serving.engine.async_llm import AsyncLLM
    from serving.entrypoints.openai.api_server import build_app
    from serving.entrypoints.openai.config import ServerConfig
    ckpt, _ = tokenizer_ckpt
    llm = AsyncLLM(str(ckpt), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                   token_buckets=[64], seq_buckets=[8], show_progress=False,
                   compilation_cache_dir=compile_cache)
    try:
        app = build_app(llm, ServerConfig(served_model_name="tiny"))
        with serve_in_thread(app) as url:
            report = _bench(tmp_path, url, "--model", "tiny", "--tokenizer", str(ckpt),
                            "--max-concurrency", "4", "--ignore-eos", "--goodput", "e2el:60000")
            chat = _bench(tmp_path, url, "--model", "tiny", "--endpoint",
                          "/v1/chat/completions", "--ignore-eos", "--num-prompts", "2")
    finally:
        llm.shutdown()
    assert report["completed"] == 6 and report["failed"] == 0, report["errors"]
    _assert_all_metrics(report)
    assert report["total_output_tokens"] == 6 * OUTPUT_LEN  # ignore_eos: exact lengths
    assert report["total_input_tokens"] == 6 * 12  # --tokenizer: exact prompt lengths
    assert report["request_goodput"] == pytest.approx(report["request_throughput"])
    assert chat["completed"] == 2 and chat["total_output_tokens"] == 2 * OUTPUT_LEN


# ---- metric definitions on synthetic data ----------------------------------------------
def _result(ttft, latency, output_tokens, itl=(), prompt_len=10):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=output_tokens,
                         ttft=ttft, latency=latency, itl=list(itl))


def test_percentiles_median_std_interpolate_linearly():
    results = [_result(ttft=ms / 1000, latency=1.0, output_tokens=2) for ms in range(1, 101)]
    report = compute_metrics(results, duration_s=10.0, percentiles=[90, 99])
    assert report["mean_ttft_ms"] == pytest.approx(50.5)
    assert report["median_ttft_ms"] == pytest.approx(50.5)
    assert report["p90_ttft_ms"] == pytest.approx(90.1)
    assert report["p99_ttft_ms"] == pytest.approx(99.01)
    assert report["std_ttft_ms"] == pytest.approx(np.std(np.arange(1, 101)))


def test_tpot_itl_e2el_and_throughput_definitions():
    results = [_result(0.1, 1.1, 11, itl=[0.1] * 10), _result(0.2, 0.2, 1),
               RequestResult(success=False, prompt_len=99, error="x")]
    report = compute_metrics(results, duration_s=2.0)
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["mean_tpot_ms"] == pytest.approx(100.0)  # (1.1 - 0.1) / 10; 1-token excluded
    assert report["mean_itl_ms"] == pytest.approx(100.0)
    assert report["mean_e2el_ms"] == pytest.approx(650.0)
    assert report["total_input_tokens"] == 20 and report["total_output_tokens"] == 12
    assert report["request_throughput"] == pytest.approx(1.0)
    assert report["output_throughput"] == pytest.approx(6.0)
    assert report["total_token_throughput"] == pytest.approx(16.0)
    assert report["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    results = [
        _result(ttft=0.10, latency=0.50, output_tokens=5),  # tpot 100 ms
        _result(ttft=0.30, latency=0.50, output_tokens=5),  # ttft too slow
        _result(ttft=0.10, latency=1.30, output_tokens=5),  # tpot 300 ms: too slow
        _result(ttft=0.10, latency=0.10, output_tokens=1),  # one token: tpot counts as 0
        RequestResult(success=False),
    ]
    slos = parse_goodput(["ttft:200", "tpot:150"])
    report = compute_metrics(results, duration_s=4.0, slos_ms=slos)
    assert report["request_goodput"] == pytest.approx(2 / 4.0)
    slos = parse_goodput(["e2el:600"])
    assert compute_metrics(results, 4.0, slos_ms=slos)["request_goodput"] == pytest.approx(3 / 4)
    assert "Request goodput" in format_table(report, [90, 99])


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:abc", "tpot:-1"])
def test_parse_goodput_rejects_bad_entries(bad):
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput([bad])


@pytest.mark.parametrize("argv, message", [
    (["--input-len", "100", "--output-len", "50", "--max-model-len", "128"], "max-model-len"),
    (["--num-prompts", "0"], "num-prompts"),
])
def test_bench_throughput_rejects_bad_lengths_before_loading(argv, message):
    from serving.bench.throughput import bench_throughput
    from serving.cli.args import engine_kwargs
    from serving.cli.main import build_parser
    args = build_parser().parse_args(["bench", "throughput", "--model", "no-such-model", *argv])
    with pytest.raises(ValueError, match=message):
        bench_throughput(args, engine_kwargs(args))
