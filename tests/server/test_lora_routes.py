"""LoRA adapters through the OpenAI server, its engine in a process of its own (`qwen-jax
serve`'s default) on the embedded model: a request's `model` picks an adapter (its greedy
output equals `LLM.generate(..., lora_request=...)`'s and differs from the base's), the
served name the base model, any other name the 404 it always was; /v1/models lists the
adapters; adapters load and unload at run time only where allowed; a bad adapter is a 400
naming the field (at start: the server does not start); the lora_requests_info gauge."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time

import aiohttp
import pytest
import torch

from qwen_jax.weights import DEFAULT_MODEL_DIR
from serving.core.lora_request import LoRARequest
from serving.core.request import SamplingParams
from tests.helpers.lora import save_peft_adapter
from tests.helpers.prometheus import parse_values
from tests.server.conftest import EMBEDDED_ENGINE, EMBEDDED_MODEL, ServerThread, wait_idle

# one step shape (a chunk of at most 32 tokens): one compile
LORA_ENGINE = {**EMBEDDED_ENGINE, "max_num_batched_tokens": 32, "token_buckets": [32],
               "enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
TARGETS = {"a0": ["q_proj", "k_proj", "v_proj", "o_proj"],
           "a1": ["gate_proj", "up_proj", "down_proj"]}
QUESTION = [{"role": "user", "content": "What is 385 + 47?"}]
MAX_TOKENS = 12
NOT_FOUND = "The model `nope` does not exist."


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """a0, a1: PEFT adapters of the embedded model; bad: a0's files with a config that
    names a method we do not serve."""
    from transformers import Qwen3MoeForCausalLM
    root = tmp_path_factory.mktemp("server_loras")
    hf = Qwen3MoeForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    loras = {}
    for i, (name, targets) in enumerate(TARGETS.items()):
        save_peft_adapter(hf, root / name, target_modules=targets, r=4, alpha=32, seed=i)
        loras[name] = LoRARequest(name, i + 1, str(root / name))
    shutil.copytree(root / "a0", root / "bad")
    config = json.loads((root / "bad" / "adapter_config.json").read_text())
    (root / "bad" / "adapter_config.json").write_text(
        json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    loras["bad"] = LoRARequest("bad", 9, str(root / "bad"))
    return loras


@pytest.fixture(scope="module")
def reference(adapters, compile_cache):
    """Greedy texts from `LLM` in this process: completions of the prompt's ids and chat
    replies, for the base model (None) and each adapter."""
    from qwen_jax import LLM
    llm = LLM(str(DEFAULT_MODEL_DIR), compilation_cache_dir=compile_cache, **LORA_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = llm.get_tokenizer().encode("385 + 47 =", False)
    loras = [None, adapters["a0"], adapters["a1"]]
    completions = llm.generate([{"prompt_token_ids": ids}] * 3, params, lora_request=loras)
    chats = llm.chat([QUESTION] * 3, params, lora_request=loras)
    names = [None, "a0", "a1"]
    return {"ids": ids,
            "completion": {n: o.outputs[0].text for n, o in zip(names, completions)},
            "chat": {n: o.outputs[0].text for n, o in zip(names, chats)}}


@pytest.fixture(scope="module")
def lora_llm(compile_cache):
    from serving.engine.process import MPAsyncLLM
    llm = MPAsyncLLM(str(DEFAULT_MODEL_DIR), compilation_cache_dir=compile_cache,
                     **LORA_ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(lora_llm, adapters):
    srv = ServerThread(lora_llm, served_model_name=EMBEDDED_MODEL,
                       lora_modules=(adapters["a0"],), allow_runtime_lora_updating=True).start()
    yield srv
    srv.stop()


async def post(session, url, body):
    async with session.post(url, json=body) as resp:
        content = await resp.json() if resp.content_type == "application/json" else \
            await resp.text()
        return resp.status, content


def completion(model, ids, **extra):
    return {"model": model, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            **extra}


def chat(model):
    return {"model": model, "messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 0}


async def test_the_model_field_picks_the_adapter(server, reference):
    assert len(set(reference["completion"].values())) == 3, \
        "an adapter gave the base model's text: the test would be blind"
    ids = reference["ids"]
    async with aiohttp.ClientSession() as s:
        for name, model in ((None, EMBEDDED_MODEL), ("a0", "a0")):
            status, body = await post(s, f"{server.url}/v1/completions", completion(model, ids))
            assert status == 200, body
            assert body["model"] == model
            assert body["choices"][0]["text"] == reference["completion"][name]
            status, body = await post(s, f"{server.url}/v1/chat/completions", chat(model))
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] == reference["chat"][name]
        status, body = await post(s, f"{server.url}/v1/responses",
                                  {"model": "a0", "input": QUESTION[0]["content"],
                                   "max_output_tokens": MAX_TOKENS, "temperature": 0})
        assert status == 200, body
        assert body["model"] == "a0"
        assert body["output"][-1]["content"][0]["text"] == reference["chat"]["a0"]


async def test_an_unknown_model_is_a_404_on_every_route(server):
    bodies = {"/v1/completions": completion("nope", [1, 2, 3]),
              "/v1/chat/completions": chat("nope"),
              "/v1/responses": {"model": "nope", "input": "hi"},
              "/tokenize": {"model": "nope", "prompt": "hi"},
              "/detokenize": {"model": "nope", "tokens": [1, 2]}}
    async with aiohttp.ClientSession() as s:
        for route, body in bodies.items():
            status, reply = await post(s, f"{server.url}{route}", body)
            assert (status, reply["error"]["message"], reply["error"]["param"]) == \
                (404, NOT_FOUND, "model"), route
        status, reply = await post(s, f"{server.url}/tokenize", {"model": "a0", "prompt": "hi"})
        assert status == 200 and reply["count"] > 0


async def test_models_lists_each_adapter_with_its_parent(server, adapters):
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{server.url}/v1/models") as resp:
            cards = {card["id"]: card for card in (await resp.json())["data"]}
    assert cards[EMBEDDED_MODEL]["parent"] is None
    assert (cards["a0"]["root"], cards["a0"]["parent"]) == (adapters["a0"].lora_path,
                                                           EMBEDDED_MODEL)
    assert "a1" not in cards


async def test_adapters_load_and_unload_at_run_time(server, adapters, reference):
    url, a1 = server.url, adapters["a1"]
    async with aiohttp.ClientSession() as s:
        load = {"lora_name": "a1", "lora_path": a1.lora_path}
        assert await post(s, f"{url}/v1/load_lora_adapter", load) == \
            (200, "Success: LoRA adapter 'a1' added successfully.")
        status, body = await post(s, f"{url}/v1/completions", completion("a1", reference["ids"]))
        assert body["choices"][0]["text"] == reference["completion"]["a1"]
        status, body = await post(s, f"{url}/v1/load_lora_adapter", load)
        assert (status, body["error"]["param"]) == (400, "lora_name")
        assert "already been loaded" in body["error"]["message"]
        async with s.get(f"{url}/v1/models") as resp:
            assert "a1" in {card["id"] for card in (await resp.json())["data"]}
        assert await post(s, f"{url}/v1/unload_lora_adapter", {"lora_name": "a1"}) == \
            (200, "Success: LoRA adapter 'a1' removed successfully.")
        status, body = await post(s, f"{url}/v1/completions", completion("a1", [1, 2]))
        assert (status, body["error"]["message"]) == (404, "The model `a1` does not exist.")
        status, body = await post(s, f"{url}/v1/unload_lora_adapter", {"lora_name": "a1"})
        assert (status, body["error"]["param"]) == (404, "lora_name")
        status, body = await post(s, f"{url}/v1/load_lora_adapter", {"lora_name": "x"})
        assert (status, body["error"]["param"]) == (400, "lora_path")


async def test_a_bad_adapter_is_a_400_naming_the_field_and_serving_goes_on(server, adapters,
                                                                         reference):
    async with aiohttp.ClientSession() as s:
        status, body = await post(s, f"{server.url}/v1/load_lora_adapter",
                                  {"lora_name": "bad", "lora_path": adapters["bad"].lora_path})
        assert (status, body["error"]["param"]) == (400, "lora_path")
        assert "peft_type" in body["error"]["message"]
        status, body = await post(s, f"{server.url}/v1/completions",
                                  completion(EMBEDDED_MODEL, reference["ids"]))
        assert status == 200 and body["choices"][0]["text"] == reference["completion"][None]
        status, body = await post(s, f"{server.url}/v1/completions", completion("bad", [1]))
        assert status == 404


async def test_runtime_loading_is_not_routed_unless_allowed(lora_llm, adapters):
    srv = ServerThread(lora_llm, served_model_name=EMBEDDED_MODEL).start()
    try:
        async with aiohttp.ClientSession() as s:
            for route in ("load_lora_adapter", "unload_lora_adapter"):
                status, _ = await post(s, f"{srv.url}/v1/{route}",
                                       {"lora_name": "a1", "lora_path": adapters["a1"].lora_path})
                assert status == 404, route
            # the engine's adapters are still served by name
            status, _ = await post(s, f"{srv.url}/v1/completions", completion("a0", [1, 2]))
            assert status == 200
    finally:
        srv.stop()


def test_a_bad_startup_adapter_stops_the_server(lora_llm, adapters):
    from serving.entrypoints.openai.lora_routes import LoRAStartupError
    with pytest.raises(LoRAStartupError, match="--lora-modules bad=.*peft_type"):
        ServerThread(lora_llm, served_model_name=EMBEDDED_MODEL,
                     lora_modules=(adapters["bad"],)).start()


def lora_info(text: str) -> tuple[dict[str, str], float]:
    """The labels and value of the one lora_requests_info series."""
    (key, value), = ((k, v) for k, v in parse_values(text).items()
                     if k.startswith("qwen_jax:lora_requests_info{"))
    return dict(re.findall(r'(\w+)="([^"]*)"', key)), value


async def test_lora_requests_info_names_the_running_adapter(server, lora_llm):
    body = {**completion("a0", [5, 6, 7]), "max_tokens": 300, "ignore_eos": True,
            "stream": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{server.url}/v1/completions", json=body) as resp:
            await resp.content.readline()  # the first chunk: the request runs
            async with s.get(f"{server.url}/metrics") as metrics:
                running, value = lora_info(await metrics.text())
        assert running == {"max_lora": "2", "running_lora_adapters": "a0",
                           "waiting_lora_adapters": ""}
        assert abs(value - time.time()) < 60
        await wait_idle(lora_llm)
        await asyncio.sleep(0.2)
        async with s.get(f"{server.url}/metrics") as metrics:
            idle, _ = lora_info(await metrics.text())
    assert idle == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
