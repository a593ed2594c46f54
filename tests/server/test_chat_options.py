"""Server options Qwen3 users reach for: --chat-template, --default-chat-template-kwargs,
prefix-cache hits in usage.prompt_tokens_details.cached_tokens, vLLM's `reasoning` field
and include_reasoning, and vLLM fields this server would ignore refused by name."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServerThread
from tests.server.test_routes import post

USER = [{"role": "user", "content": "Hello there, how are you today?"}]
TEMPLATE = "{% for m in messages %}<<{{ m.role }}|{{ m.content }}>>{% endfor %}{{ greeting }}"


@pytest.fixture(scope="module")
def templated(shared_llm, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    srv = ServerThread(shared_llm, served_model_name="tiny", chat_template=str(path),
                       default_chat_template_kwargs={"greeting": "!!"}).start()
    yield srv
    srv.stop()


async def test_chat_template_file_and_default_kwargs_render_the_prompt(templated):
    status, body = await post(templated, "/tokenize", {"messages": USER})
    expected = templated.llm.tokenizer.encode("<<user|Hello there, how are you today?>>!!")
    assert status == 200 and body["tokens"] == expected
    status, body = await post(templated, "/tokenize", {
        "messages": USER, "chat_template_kwargs": {"greeting": "?"}})  # the request wins
    assert body["tokens"] == templated.llm.tokenizer.encode(
        "<<user|Hello there, how are you today?>>?")


def test_a_template_that_is_neither_file_nor_jinja_is_refused(shared_llm):
    with pytest.raises(ValueError, match="chat_template"):
        ServerThread(shared_llm, chat_template="/no/such/file.jinja").start()


async def test_repeated_prompt_reports_cached_tokens(server):
    body = {"messages": USER * 4, "max_tokens": 2, "temperature": 0}
    _, first = await post(server, "/v1/chat/completions", body)
    _, second = await post(server, "/v1/chat/completions", body)
    prompt = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] < prompt
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= prompt - prompt % 16 - 16 and cached > 0  # whole pages of 16


@pytest.fixture(scope="module")
def reasoning(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny", reasoning_parser="qwen3").start()
    yield srv
    srv.stop()


async def test_include_reasoning_false_drops_the_reasoning_fields(reasoning):
    body = {"messages": USER, "max_tokens": 3, "temperature": 0}
    _, shown = await post(reasoning, "/v1/chat/completions", body)
    message = shown["choices"][0]["message"]
    assert "reasoning" in message and message["reasoning"] == message["reasoning_content"]
    _, hidden = await post(reasoning, "/v1/chat/completions", {**body, "include_reasoning": False})
    message = hidden["choices"][0]["message"]
    assert "reasoning" not in message and "reasoning_content" not in message
    assert message["content"] == shown["choices"][0]["message"]["content"]
