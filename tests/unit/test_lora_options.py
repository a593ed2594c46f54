"""The LoRA options as users give them: `--lora-modules` in both of vLLM's forms (ids in
order) and its errors naming the flag, the engine options on every command that builds an
engine, the runtime-updating switch (flag or vLLM's environment variable), a JSONL line's
`lora` field, `LLM.generate`'s per-prompt adapters, and a LoRARequest that crosses the
engine process's pipe."""

from __future__ import annotations

import pickle
import re

import pytest

from serving.cli.args import engine_kwargs
from serving.cli.main import build_parser, main
from serving.core.lora_request import LoRARequest
from serving.entrypoints.line_adapters import LineAdapters
from serving.entrypoints.llm import per_prompt_loras
from serving.entrypoints.openai.lora_routes import runtime_updating_allowed

COMMANDS = (["serve"], ["generate", "--input", "in.jsonl", "--output", "out.jsonl"],
            ["bench", "throughput"])
JSON_MODULE = '{"name": "sql", "path": "/loras/sql", "base_model_name": "base"}'


@pytest.mark.parametrize("command", COMMANDS)
def test_both_module_forms_parse_in_order_on_every_engine_command(command):
    args = build_parser().parse_args([
        *command, "--enable-lora", "--max-loras", "3", "--max-lora-rank", "32",
        "--max-cpu-loras", "5", "--lora-modules", "chat=/loras/chat", JSON_MODULE,
        "--lora-modules", "more=/a=b"])
    assert args.lora_modules == [LoRARequest("chat", 1, "/loras/chat"),
                                 LoRARequest("sql", 2, "/loras/sql", "base"),
                                 LoRARequest("more", 3, "/a=b")]
    kwargs = engine_kwargs(args)
    assert {k: kwargs[k] for k in ("enable_lora", "max_loras", "max_lora_rank",
                                   "max_cpu_loras")} == {
        "enable_lora": True, "max_loras": 3, "max_lora_rank": 32, "max_cpu_loras": 5}
    assert "lora_modules" not in kwargs  # registered by the command, not an engine option


def test_lora_is_off_by_default():
    args = build_parser().parse_args(["serve"])
    assert (args.enable_lora, args.lora_modules, args.allow_runtime_lora_updating) == \
        (False, [], False)
    assert engine_kwargs(args)["max_loras"] == 1


@pytest.mark.parametrize("item, reason", [
    ("chat", "neither NAME=PATH nor a JSON object"),
    ("=/loras/chat", "name must be a non-empty string"),
    ("chat=", "path must be a non-empty string"),
    ('{"name": "x"', "not valid JSON"),
    ('{"name": "x", "path": "/p", "rank": 8}', r"unknown field\(s\) \['rank'\]"),
    ('{"name": "x"}', "path must be a non-empty string"),
    ('{"name": "x", "path": "/p", "base_model_name": 3}', "base_model_name must be a string"),
])
def test_a_bad_module_is_an_error_naming_the_flag(item, reason, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", item])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --lora-modules" in err
    assert re.search(reason, err), err


def test_a_name_given_twice_is_an_error(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--enable-lora", "--lora-modules", "a=/x",
                                   "--lora-modules", "a=/y"])
    assert "adapter name 'a' is given twice" in capsys.readouterr().err


@pytest.mark.parametrize("command", COMMANDS)
def test_modules_without_enable_lora_stop_before_any_engine(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([*command, "--lora-modules", "a=/x"])
    assert exc.value.code == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err


@pytest.mark.parametrize("flag, env, allowed", [
    (False, {}, False), (True, {}, True),
    (False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, True),
    (False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": " 1 "}, True),
    (False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "false"}, False),
    (False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "yes"}, False)])
def test_runtime_updating_by_flag_or_vllm_env(flag, env, allowed):
    assert runtime_updating_allowed(flag, env) is allowed


def test_serve_flag_for_runtime_updating():
    assert build_parser().parse_args(["serve", "--allow-runtime-lora-updating"]
                                     ).allow_runtime_lora_updating


def test_a_line_names_a_module_or_gives_its_own():
    chat = LoRARequest("chat", 1, "/loras/chat")
    adapters = LineAdapters([chat, LoRARequest("sql", 4, "/loras/sql")])
    assert adapters.resolve(None) is None
    assert adapters.resolve("chat") is chat
    inline = adapters.resolve({"name": "new", "path": "/loras/new"})
    assert inline == LoRARequest("new", 5, "/loras/new")  # numbered after the modules
    assert adapters.resolve({"name": "new", "path": "/loras/new"}) is inline
    assert adapters.resolve("new") is inline  # later lines may name it


@pytest.mark.parametrize("value, reason", [
    ("nope", "'lora' 'nope' is not a known adapter"),
    (3, "'lora' must be an adapter name or"),
    ({"name": "x"}, "'lora.path' must be a non-empty string"),
    ({"name": "", "path": "/p"}, "'lora.name' must be a non-empty string"),
    ({"name": "x", "path": "/p", "r": 4}, r"'lora' has unknown field\(s\) \['r'\]"),
    ({"name": "chat", "path": "/other"}, "'lora.path' '/other': adapter 'chat' is already"),
])
def test_a_bad_lora_field_names_it(value, reason):
    adapters = LineAdapters([LoRARequest("chat", 1, "/loras/chat")])
    with pytest.raises(ValueError, match=reason):
        adapters.resolve(value)


def test_generate_takes_one_adapter_or_one_per_prompt():
    lora = LoRARequest("a", 1, "/a")
    assert per_prompt_loras(None, 2) == [None, None]
    assert per_prompt_loras(lora, 2) == [lora, lora]
    assert per_prompt_loras([None, lora], 2) == [None, lora]
    with pytest.raises(ValueError, match="got 1 lora_requests for 2 prompts"):
        per_prompt_loras([lora], 2)
    with pytest.raises(ValueError, match=r"lora_request\[1\] must be a LoRARequest"):
        per_prompt_loras([lora, "a"], 2)
    with pytest.raises(ValueError, match="lora_request must be a LoRARequest"):
        per_prompt_loras("a", 2)


def test_a_lora_request_survives_the_engine_process_pipe():
    lora = LoRARequest("a", 3, "/loras/a", "base")
    assert pickle.loads(pickle.dumps(lora, protocol=pickle.HIGHEST_PROTOCOL)) == lora
