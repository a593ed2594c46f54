"""Sampling defaults from generation_config.json (vLLM's --generation-config): a request
that omits a field gets the checkpoint's value, an explicit one wins, `vllm` is neutral.
And the serve flags for tools and chat templates reach the server's config."""

from __future__ import annotations

import json

import pytest

from serving.engine.generation_config import sampling_defaults
from serving.entrypoints.openai.protocol import parse_chat, parse_completion

QWEN3_GENERATION = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                    "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                    "transformers_version": "4.51.0"}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def qwen3_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3_GENERATION))
    return tmp_path


def test_auto_reads_the_sampling_fields(qwen3_dir, tmp_path_factory):
    assert sampling_defaults(qwen3_dir) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert sampling_defaults(tmp_path_factory.mktemp("bare")) == {}  # no file: neutral
    assert sampling_defaults(None) == {}


def test_vllm_mode_is_neutral_and_a_directory_names_another_file(qwen3_dir, tmp_path_factory):
    assert sampling_defaults(qwen3_dir, "vllm") == {}
    other = tmp_path_factory.mktemp("other")
    assert sampling_defaults(other, str(qwen3_dir))["temperature"] == 0.6
    with pytest.raises(ValueError, match="generation_config"):
        sampling_defaults(qwen3_dir, "greedy")


@pytest.mark.parametrize("parse, body", [(parse_chat, {"messages": MESSAGES}),
                                         (parse_completion, {"prompt": "hi"})])
def test_requests_get_the_defaults_unless_they_say_otherwise(qwen3_dir, parse, body):
    defaults = sampling_defaults(qwen3_dir)
    sampling = parse(body, 1000, defaults).sampling
    assert (sampling["temperature"], sampling["top_p"], sampling["top_k"]) == (0.6, 0.95, 20)
    explicit = parse({**body, "temperature": 1.0, "top_k": -1}, 1000, defaults).sampling
    assert (explicit["temperature"], explicit["top_k"], explicit["top_p"]) == (1.0, -1, 0.95)
    neutral = parse(body, 1000, {}).sampling
    assert (neutral["temperature"], neutral["top_p"], neutral["top_k"]) == (1.0, 1.0, -1)


def test_serve_flags_reach_the_server_config():
    from serving.cli.main import build_parser
    from serving.entrypoints.openai.config import ServerConfig
    args = build_parser().parse_args([
        "serve", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--default-chat-template-kwargs", '{"enable_thinking": false}',
        "--generation-config", "vllm"])
    assert (args.tool_call_parser, args.enable_auto_tool_choice) == ("hermes", True)
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert args.generation_config == "vllm"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--default-chat-template-kwargs", "[1]"])
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="mistral")


def test_serve_steps_the_engine_in_its_own_process_unless_told_or_multi_host(monkeypatch):
    import jax

    from serving.cli.main import build_parser
    from serving.entrypoints.openai import serve_process
    built, platforms = [], []
    monkeypatch.setattr(serve_process, "AsyncLLM", lambda *a, **k: built.append("thread"))
    monkeypatch.setattr(serve_process, "MPAsyncLLM", lambda *a, **k: built.append("process"))
    monkeypatch.setattr(jax.config, "update", lambda name, value: platforms.append(value))
    for argv in (["serve"], ["serve", "--no-engine-process"],
                 ["serve", "--coordinator-address", "host:1234"]):
        serve_process.start_engine(build_parser().parse_args(argv), {})
    assert built == ["process", "thread", "thread"]
    assert platforms == ["cpu"]  # the server's process then keeps off the GPU
