"""LoRA in the engine on the embedded tiny model: a batch mixing three adapters and the
base gives each request what it gets alone, also when the adapters outnumber the device
slots (requests wait for a slot, none blocks the others) and host copies are evicted;
the prefix cache never shares pages across adapters; adapters load and unload while
requests run without changing any output."""

import numpy as np
import pytest
import torch

from qwen_jax import LLM, SamplingParams
from qwen_jax.weights import DEFAULT_MODEL_DIR
from serving.core.lora_request import LoRARequest
from tests.helpers.lora import save_peft_adapter

ENGINE = dict(compilation_cache_dir=None, show_progress=False, max_num_seqs=8,
              max_num_batched_tokens=64, token_buckets=[16, 64], seq_buckets=[8],
              max_model_len=128, enable_lora=True, max_lora_rank=8)
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
TARGETS = [["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"],
           ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]]
PROMPTS = [list(range(5, 5 + n)) for n in (9, 21, 4, 17, 30, 12)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    from transformers import Qwen3MoeForCausalLM
    root = tmp_path_factory.mktemp("engine_loras")
    hf = Qwen3MoeForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    loras = []
    for i, targets in enumerate(TARGETS):
        save_peft_adapter(hf, root / f"a{i}", target_modules=targets, r=4 + 2 * i, seed=i,
                          alpha=32)
        loras.append(LoRARequest(f"a{i}", i + 1, str(root / f"a{i}")))
    return loras


def run(engine, jobs) -> list[list[int]]:
    """jobs: (prompt ids, lora or None) -> greedy token ids, all in one batch."""
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PARAMS, stream=False,
                           lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[f"r{i}"] for i in range(len(jobs))]


@pytest.fixture(scope="module")
def alone(adapters):
    """Each (prompt, adapter) run by itself, and the base model's outputs."""
    engine = LLM(**ENGINE, max_loras=1).llm_engine
    jobs = [(p, [None, *adapters][i % 4]) for i, p in enumerate(PROMPTS)]
    outputs = [run(engine, [job])[0] for job in jobs]
    return jobs, outputs


def test_adapters_change_the_output(alone):
    jobs, outputs = alone
    base = {tuple(p): out for (p, lora), out in zip(jobs, outputs) if lora is None}
    changed = [out != base.get(tuple(p), None) for (p, lora), out in zip(jobs, outputs)
               if lora is not None]
    assert any(changed), "no adapter changed its request's tokens: the test would be blind"


@pytest.mark.parametrize("max_loras,max_cpu_loras", [(3, None), (2, 2)])
def test_mixed_batch_equals_each_alone(adapters, alone, max_loras, max_cpu_loras):
    jobs, outputs = alone
    engine = LLM(**ENGINE, max_loras=max_loras, max_cpu_loras=max_cpu_loras).llm_engine
    assert run(engine, jobs) == outputs
    assert engine.lora.slots.running_adapters() == []


def test_prefix_cache_keys_include_the_adapter(adapters, alone):
    engine = LLM(**ENGINE, max_loras=2, enable_prefix_caching=True).llm_engine
    prompt = PROMPTS[4]  # 30 tokens: one full page of 16 to share
    base = run(engine, [(prompt, None)])[0]
    with_a0 = run(engine, [(prompt, adapters[0])])[0]
    again = run(engine, [(prompt, adapters[0])])[0]
    assert with_a0 == again
    fresh = LLM(**ENGINE, max_loras=2, enable_prefix_caching=False).llm_engine
    assert run(fresh, [(prompt, adapters[0])])[0] == with_a0
    assert run(fresh, [(prompt, None)])[0] == base


def test_load_and_unload_while_requests_run(adapters, alone):
    jobs, outputs = alone
    engine = LLM(**ENGINE, max_loras=2).llm_engine
    assert engine.add_lora(adapters[0]) and not engine.add_lora(adapters[0])
    for i, (prompt, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PARAMS, stream=False,
                           lora_request=lora)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps == 2:
            assert engine.remove_lora("a0")  # its requests keep it until they finish
            engine.add_lora(LoRARequest("late", 9, adapters[1].lora_path))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(len(jobs))] == outputs
    assert [lora.lora_name for lora in engine.list_loras()] == ["a1", "a2", "late"]


def test_bad_adapters_name_the_field(adapters, tmp_path):
    engine = LLM(**ENGINE, max_loras=1).llm_engine
    with pytest.raises(ValueError, match="adapter_config.json"):
        engine.add_request("x", [1, 2, 3], PARAMS,
                           lora_request=LoRARequest("missing", 7, str(tmp_path)))
    engine.add_lora(adapters[0])
    with pytest.raises(ValueError, match="lora_name"):
        engine.add_lora(LoRARequest("a0", 8, adapters[1].lora_path))
    with pytest.raises(ValueError, match="lora_int_id"):
        engine.add_lora(LoRARequest("other", 1, adapters[1].lora_path))
    assert not engine.has_unfinished_requests()
    plain = LLM(**{**ENGINE, "enable_lora": False}).llm_engine
    with pytest.raises(ValueError, match="enable_lora"):
        plain.add_request("y", [1, 2, 3], PARAMS, lora_request=adapters[0])
    assert np.all(run(engine, [(PROMPTS[0], adapters[0])])[0] ==
                  run(engine, [(PROMPTS[0], adapters[0])])[0])
