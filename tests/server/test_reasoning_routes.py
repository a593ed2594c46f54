"""`--reasoning-parser qwen3` on the embedded tiny thinking model: chat replies split into
reasoning_content and content, streamed and not; off, the reply is unchanged."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerThread
from tests.server.test_routes import post, stream_events

SUM = {"messages": [{"role": "user", "content": "What is 385 + 47?"}], "max_tokens": 40,
       "temperature": 0}
RAW = "<think>\n2 3 4\n</think>\n\n432"  # what the model writes for SUM


@pytest.fixture(scope="module")
def thinking_llm(compile_cache):
    from qwen_jax.weights import DEFAULT_MODEL_DIR
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(DEFAULT_MODEL_DIR), compilation_cache_dir=compile_cache, max_num_seqs=4,
                   max_num_batched_tokens=64, max_model_len=128, token_buckets=[8, 64],
                   seq_buckets=[4], show_progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def parsed(thinking_llm):
    srv = ServerThread(thinking_llm, reasoning_parser="qwen3").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def unparsed(thinking_llm):
    srv = ServerThread(thinking_llm).start()
    yield srv
    srv.stop()


def joined(chunks: list[dict], key: str, index: int = 0) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks
                   if c["choices"][0]["index"] == index)


async def test_reply_splits_into_reasoning_and_content(parsed):
    status, body = await post(parsed, "/v1/chat/completions", SUM)
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "reasoning_content": "2 3 4",
                                             "reasoning": "2 3 4", "content": "432"}
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_streamed_reply_splits_the_same_way(parsed):
    events = await stream_events(parsed, "/v1/chat/completions", {**SUM, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert joined(chunks, "reasoning_content") == "2 3 4" and joined(chunks, "content") == "432"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_each_streamed_choice_is_parsed_on_its_own(parsed):
    events = await stream_events(parsed, "/v1/chat/completions",
                                 {**SUM, "n": 2, "stream": True})
    chunks = events[:-1]
    for index in (0, 1):
        assert joined(chunks, "reasoning_content", index) == "2 3 4"
        assert joined(chunks, "content", index) == "432"


async def test_completions_route_is_not_parsed(parsed):
    status, chat = await post(parsed, "/tokenize", {"messages": SUM["messages"]})
    prompt = {"prompt": chat["tokens"], "max_tokens": 40, "temperature": 0}
    status, body = await post(parsed, "/v1/completions", prompt)
    assert status == 200 and body["choices"][0]["text"] == RAW
    assert "reasoning_content" not in body["choices"][0]


async def test_without_a_parser_the_think_block_stays_in_content(unparsed):
    status, body = await post(unparsed, "/v1/chat/completions", SUM)
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": RAW}
    events = await stream_events(unparsed, "/v1/chat/completions", {**SUM, "stream": True})
    chunks = events[:-1]
    assert joined(chunks, "content") == RAW
    assert not any("reasoning_content" in c["choices"][0]["delta"] for c in chunks)


def test_server_config_rejects_an_unknown_parser():
    from serving.entrypoints.openai.config import ServerConfig
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['qwen3'\], "
                                         r"got 'deepseek_r1'"):
        ServerConfig(reasoning_parser="deepseek_r1")


def test_serve_cli_rejects_an_unknown_parser_naming_the_choices(capsys):
    from serving.cli.main import build_parser
    assert build_parser().parse_args(["serve"]).reasoning_parser is None
    assert build_parser().parse_args(
        ["serve", "--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --reasoning-parser: invalid choice: 'deepseek_r1'" in err
    assert "'qwen3'" in err
