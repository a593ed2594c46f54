"""`qwen-jax generate`: a kill -9 mid-run loses nothing and duplicates nothing on resume;
bad lines are reported with their line numbers while the good ones complete."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "96",
          "--token-buckets", "64", "--seq-buckets", "8"]


def _generate(ckpt, cache, inp, out, *extra, wait=True):
    cmd = [sys.executable, "-m", "serving.cli.main", "generate", "--model", str(ckpt),
           "--input", str(inp), "--output", str(out), "--compilation-cache-dir", str(cache),
           "--no-progress", "--temperature", "0", *ENGINE, *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _lines(path):
    raw = Path(path).read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "torn last line"
    return [json.loads(line) for line in raw.splitlines()]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_resume_after_kill_gives_every_id_exactly_once(tmp_path, tokenizer_ckpt,
                                                        compile_cache):
    ckpt, _ = tokenizer_ckpt
    # Short requests first: results appear early while the long ones are still decoding.
    rows = [{"id": f"s{i}", "prompt": f"short {i}", "max_tokens": 1} for i in range(3)]
    rows += [{"id": f"l{i}", "prompt": f"a longer prompt number {i}", "max_tokens": 32,
              "ignore_eos": True} for i in range(9)]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(inp, rows)

    proc = _generate(ckpt, compile_cache, inp, out, wait=False)
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline and proc.poll() is None:
        if out.exists() and out.stat().st_size > 0:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    first = _lines(out)
    assert 1 <= len(first) < len(rows)
    with open(out, "ab") as f:  # what a kill during a write could leave at worst
        f.write(b'{"id": "l5", "text": "torn')

    summary = _generate(ckpt, compile_cache, inp, out)
    results = _lines(out)
    ids = [r["id"] for r in results]
    assert sorted(ids) == sorted(r["id"] for r in rows)  # every id exactly once
    assert summary["skipped"] == len(first) and summary["completed"] == len(rows) - len(first)
    for r in results:
        want = 1 if r["id"].startswith("s") else 32
        assert len(r["token_ids"]) == want == r["usage"]["completion_tokens"]
        assert r["usage"]["total_tokens"] == r["usage"]["prompt_tokens"] + want
        assert r["finish_reason"] == "length" and r["timing"]["e2e_s"] >= r["timing"]["ttft_s"]


def test_bad_lines_are_reported_and_good_ones_complete(tmp_path, tokenizer_ckpt,
                                                       compile_cache):
    ckpt, _ = tokenizer_ckpt
    rows = [
        {"id": "ok-text", "prompt": "Hello there", "max_tokens": 3},
        "{not json",
        {"id": "ok-ids", "prompt": [9707, 1052], "max_tokens": 2},
        {"prompt": "no id"},
        {"id": "ok-text", "prompt": "duplicate"},
        {"id": "both", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
        {"id": "neither"},
        {"id": "bad-temp", "prompt": "x", "temperature": -1},
        {"id": "too-long", "prompt": list(range(1, 200))},
        {"id": "ok-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        "",
        {"id": 7, "prompt": "numeric id", "max_tokens": 1, "metadata": {"k": 1}},
        {"id": "ok-choice", "prompt": "Pick one", "temperature": 1.0,
         "structured_outputs": {"choice": ["red", "blue"]}},
        {"id": "bad-regex", "prompt": "x", "structured_outputs": {"regex": "[a-"}},
    ]
    inp, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    _write_jsonl(inp, rows)
    summary = _generate(ckpt, compile_cache, inp, out, "--errors", str(errors))
    results = {r["id"]: r for r in _lines(out)}
    assert set(results) == {"ok-text", "ok-ids", "ok-chat", 7, "ok-choice"}
    assert results["ok-choice"]["text"] in ("red", "blue")
    assert len(results["ok-ids"]["token_ids"]) == 2 and results[7]["metadata"] == {"k": 1}
    reported = {e["line"]: e for e in _lines(errors)}
    assert sorted(reported) == [2, 4, 5, 6, 7, 8, 9, 14]
    assert "invalid JSON" in reported[2]["error"]
    assert "'id'" in reported[4]["error"]
    assert "duplicate id" in reported[5]["error"]
    assert "exactly one of" in reported[6]["error"] and "exactly one of" in reported[7]["error"]
    assert "temperature" in reported[8]["error"] and reported[8]["id"] == "bad-temp"
    assert "max_model_len" in reported[9]["error"]
    assert "regex" in reported[14]["error"] and reported[14]["id"] == "bad-regex"
    assert summary["completed"] == 5 and summary["errors"] == 8
    again = _generate(ckpt, compile_cache, inp, out, "--errors", str(errors))
    assert again["completed"] == 0 and again["skipped"] == 5 and len(_lines(out)) == 5
    assert len(_lines(errors)) == 8  # a rerun does not report the same lines again


def test_torn_tail_is_truncated_and_ids_collected(tmp_path):
    from serving.entrypoints.generate_file import JsonlAppender
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "te')
    appender = JsonlAppender(path)
    assert [r["id"] for r in appender.recover()] == ["a", "b"]
    appender.write({"id": "c"})
    appender.close()
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n{"id": "c"}\n'


def test_generate_file_rejects_unknown_default_sampling(tmp_path):
    from serving.entrypoints.generate_file import generate_file
    (tmp_path / "in.jsonl").write_text("")
    with pytest.raises(ValueError, match="max_token"):
        generate_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", llm=object(),
                      default_sampling={"max_token": 3})


def test_a_record_cannot_ask_for_streamed_outputs():
    from serving.entrypoints.generate_file import BadLine, _parse_fields
    with pytest.raises(BadLine, match=r"unknown field\(s\) \['output_kind'\].*final output"):
        _parse_fields({"id": "a", "prompt": "hi", "output_kind": "DELTA"}, 1, None, {}, None)


def test_a_request_the_engine_fails_is_reported_and_the_rest_complete(tmp_path, tokenizer_ckpt,
                                                                      compile_cache):
    from serving.entrypoints.generate_file import generate_file
    from serving.entrypoints.llm import LLM
    from tests.helpers.failures import corrupt_token_after
    ckpt, _ = tokenizer_ckpt
    llm = LLM(str(ckpt), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
              token_buckets=[64], seq_buckets=[8], compilation_cache_dir=str(compile_cache))
    corrupt_token_after(llm.llm_engine, marker=4242)
    inp, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    _write_jsonl(inp, [{"id": "ok", "prompt": [11, 12, 13], "max_tokens": 3},
                       {"id": "victim", "prompt": [11, 12, 4242], "max_tokens": 3}])
    summary = generate_file(inp, out, llm=llm, errors_path=errors, progress=False)
    assert [r["id"] for r in _lines(out)] == ["ok"]
    (error,) = _lines(errors)
    assert error["id"] == "victim" and "sampled token id -7" in error["error"]
    assert summary["completed"] == 1 and summary["errors"] == 1
    # The offline API hands the failed request back finished, with the reason.
    failed, fine = llm.generate([{"prompt_token_ids": [5, 4242]}, {"prompt_token_ids": [5, 6]}])
    assert failed.finished and failed.outputs[0].finish_reason == "error" and failed.error
    assert fine.error is None and fine.outputs[0].finish_reason is not None
    assert llm.stats()["num_used_pages"] == 0
