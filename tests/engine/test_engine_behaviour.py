"""Engine behaviour beyond parity: aborts, leaks, compiles, seeds, n, stops, logprobs."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from qwen_jax import LLM, RequestOutputKind, SamplingParams
from qwen_jax.options import KV_CACHE_DTYPES
from qwen_jax.params import resolve_kv_cache_dtype
from serving.core.config import CacheConfig
from serving.engine.config import engine_config_from_kwargs
from serving.engine.llm_engine import LLMEngine
from tests.engine.conftest import make_prompts
from tests.helpers.hf import hf_logits

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   token_buckets=[8, 64], seq_buckets=[4, 8], show_progress=False)


@pytest.fixture(scope="module")
def llm(tiny_ckpt, compile_cache):
    return LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache, **ENGINE_ARGS)


@pytest.fixture(scope="module")
def tok_llm(tokenizer_ckpt, compile_cache):
    return LLM(str(tokenizer_ckpt[0]), compilation_cache_dir=compile_cache, **ENGINE_ARGS)


def ids_prompt(p):
    return {"prompt_token_ids": p}


def test_text_prompt_without_tokenizer_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate("hello")
    out = llm.generate(ids_prompt([3, 4, 5]), SamplingParams(max_tokens=3, temperature=0))
    assert out[0].outputs[0].text == "" and len(out[0].outputs[0].token_ids) == 3


def test_out_of_vocab_token_is_rejected_with_field_and_limit(llm):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\].*vocab_size=96"):
        llm.generate(ids_prompt([3, 500]))
    assert llm.stats()["num_waiting"] == 0


def test_abort_frees_pages_at_once(tiny_ckpt, compile_cache):
    engine = LLMEngine(engine_config_from_kwargs(str(tiny_ckpt[0]), precompile=False,
                                                 compilation_cache_dir=compile_cache,
                                                 **ENGINE_ARGS))
    for i, p in enumerate(make_prompts([20, 40, 7])):
        engine.add_request(str(i), ids_prompt(p), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    total = engine.stats()["num_total_pages"]
    used = total - engine.stats()["num_free_pages"]
    assert used > 0
    engine.abort("1")
    assert total - engine.stats()["num_free_pages"] < used
    engine.abort("0")
    engine.abort("2")
    stats = engine.stats()
    assert stats["num_free_pages"] == total and stats["num_running"] == 0
    assert not engine.has_unfinished_requests() and engine.step() == []


def test_no_compilation_after_warmup(llm):
    before = llm.stats()["num_compiles"]
    assert before > 0  # precompile built every bucket
    prompts = [ids_prompt(p) for p in make_prompts([1, 3, 60, 17, 33, 2, 9, 50, 11], seed=5)]
    params = [SamplingParams(temperature=0.0, max_tokens=5),
              SamplingParams(temperature=0.8, top_p=0.9, top_k=10, seed=1, max_tokens=9),
              SamplingParams(n=2, temperature=1.0, max_tokens=4, logprobs=3),
              SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5, max_tokens=6)] * 3
    llm.generate(prompts, params[:len(prompts)])
    assert llm.stats()["num_compiles"] == before


def test_structured_outputs_compile_nothing_after_warmup(tok_llm):
    """Constrained rows next to free ones, alone, and none at all: the same executables,
    and XLA never compiles (the mask is one more argument of every bucket's step)."""
    from jax import monitoring
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: compiles.append(name)
        if name == "/jax/core/compile/backend_compile_duration" else None)
    before = tok_llm.stats()["num_compiles"]
    regex = SamplingParams(temperature=1.0, seed=1, max_tokens=8,
                           structured_outputs={"regex": "[a-z]{3,6}"})
    choice = SamplingParams(temperature=0.0, max_tokens=8, n=2,
                            structured_outputs={"choice": ["yes", "no"]})
    free = SamplingParams(temperature=0.7, seed=2, max_tokens=6)
    prompts = ["Hello there", "One two three four five six", "x"]
    outs = tok_llm.generate(prompts, [regex, choice, free])
    assert outs[1].outputs[0].text in ("yes", "no")
    tok_llm.generate(prompts[:1], regex)
    tok_llm.generate(prompts[:2], free)
    assert tok_llm.stats()["num_compiles"] == before and compiles == []


def test_seeded_sampling_is_reproducible_and_batch_independent(llm, tiny_ckpt, compile_cache):
    target = ids_prompt(make_prompts([12], seed=9)[0])
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=10,
                            ignore_eos=True)
    alone = llm.generate(target, params)[0].outputs[0].token_ids
    others = [ids_prompt(p) for p in make_prompts([30, 5, 44], seed=10)]
    mixed = llm.generate(others[:2] + [target] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=12)] * 2 + [params]
                         + [SamplingParams(temperature=0.0, max_tokens=3)])
    assert mixed[2].outputs[0].token_ids == alone
    second_run = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache, **ENGINE_ARGS)
    assert second_run.generate(target, params)[0].outputs[0].token_ids == alone


def test_n_samples_return_n_distinct_completions(llm):
    out = llm.generate(ids_prompt([5, 6, 7]), SamplingParams(n=3, temperature=1.0, seed=3,
                                                               max_tokens=8, ignore_eos=True))
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in comps}) > 1
    assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in comps)


def test_logprobs_equal_hf_log_softmax(llm, tiny_ckpt):
    prompt = make_prompts([10], seed=4)[0]
    out = llm.generate(ids_prompt(prompt), SamplingParams(temperature=0.0, max_tokens=5,
                                                           logprobs=3, ignore_eos=True))[0]
    comp = out.outputs[0]
    full = prompt + comp.token_ids
    logits = hf_logits(tiny_ckpt[1], np.array([full]))[0]
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    total = 0.0
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert entry[token].rank == 1
        assert abs(entry[token].logprob - row[token]) < 1e-4
        top3 = np.argsort(-row)[:3]
        assert set(top3) <= set(entry)
        total += row[token]
    assert abs(comp.cumulative_logprob - total) < 1e-3


def test_eos_stops_unless_ignored_and_min_tokens_delays_it(llm, tiny_ckpt):
    prompt = make_prompts([6], seed=12)[0]
    free = llm.generate(ids_prompt(prompt), SamplingParams(temperature=0.0, max_tokens=20,
                                                           ignore_eos=True))[0].outputs[0]
    eos = free.token_ids[2]  # pretend the third greedy token is the stop token
    stopped = llm.generate(ids_prompt(prompt), SamplingParams(
        temperature=0.0, max_tokens=20, stop_token_ids=[eos]))[0].outputs[0]
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(eos) + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == eos
    delayed = llm.generate(ids_prompt(prompt), SamplingParams(
        temperature=0.0, max_tokens=20, stop_token_ids=[eos], min_tokens=5))[0].outputs[0]
    assert len(delayed.token_ids) >= 5 and eos not in delayed.token_ids[:5]


def test_stop_strings_cut_across_token_boundaries(tok_llm):
    tok = tok_llm.get_tokenizer()
    prompt = ids_prompt(tok.encode("Once upon a time"))
    free = tok_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6
    stop = text[3:6]  # a snippet that need not align with token boundaries
    out = tok_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                  stop=[stop]))[0].outputs[0]
    assert out.text == text[:text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = tok_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop],
                                                   include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == text[:text.index(stop) + len(stop)]


def test_chat_uses_the_checkpoint_template(tok_llm):
    tok = tok_llm.get_tokenizer()
    messages = [{"role": "user", "content": "Hi there"}]
    out = tok_llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=4),
                       chat_template_kwargs={"enable_thinking": False})[0]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       enable_thinking=False)
    assert out.prompt_token_ids == expected
    assert "<think>" in tok.decode(expected, skip_special_tokens=False)


def test_prompt_logprobs_equal_hf_log_softmax(llm, tiny_ckpt):
    prompt = make_prompts([9], seed=14)[0]
    out = llm.generate(ids_prompt(prompt), SamplingParams(temperature=0.0, max_tokens=2,
                                                           prompt_logprobs=2))[0]
    logits = hf_logits(tiny_ckpt[1], np.array([prompt]))[0]
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[i]
        assert abs(entry[token].logprob - ref[i - 1][token]) < 1e-4
        assert entry[token].rank == 1 + int(np.sum(ref[i - 1] > ref[i - 1][token]))
        assert set(np.argsort(-ref[i - 1])[:2]) <= set(entry)


def test_max_model_len_defaults_to_the_models(tiny_ckpt, compile_cache):
    engine = LLMEngine(engine_config_from_kwargs(
        str(tiny_ckpt[0]), precompile=False, compilation_cache_dir=compile_cache,
        max_num_seqs=4, max_num_batched_tokens=64))
    assert engine.max_model_len == 256  # the checkpoint's max_position_embeddings
    with pytest.raises(ValueError, match="max_model_len=512 exceeds"):
        LLMEngine(engine_config_from_kwargs(str(tiny_ckpt[0]), precompile=False,
                                            max_model_len=512))


def test_fp8_kv_cache_quarters_page_bytes_and_stays_close(llm, tiny_ckpt, compile_cache):
    fp8 = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache, kv_cache_dtype="fp8_e4m3",
              **ENGINE_ARGS)
    assert fp8.stats()["bytes_per_page"] * 4 == llm.stats()["bytes_per_page"]  # vs float32
    assert fp8.llm_engine.runner.kv_caches[0][0].dtype == np.dtype("float8_e4m3fn")
    prompts = [ids_prompt(p) for p in make_prompts([5, 33, 12], seed=31)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)
    for ours, base in zip(fp8.generate(prompts, params), llm.generate(prompts, params)):
        # Scale 1.0 (vLLM's default without calibration): same first token, close logprobs.
        assert ours.outputs[0].token_ids[0] == base.outputs[0].token_ids[0]
        first = lambda o: o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob
        assert abs(first(ours) - first(base)) < 0.05


def test_config_and_cache_accept_the_same_kv_cache_dtypes():
    # One list: everything the config accepts, the cache allocates; int8 (which would
    # need calibrated scales) is refused when the config is built, naming the choices.
    for name, stored in KV_CACHE_DTYPES.items():
        assert CacheConfig(kv_cache_dtype=name).kv_cache_dtype == name
        dtype = resolve_kv_cache_dtype(name, jnp.bfloat16)
        assert dtype == (jnp.bfloat16 if stored is None else jnp.dtype(stored))
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, .*fp8_e5m2, "
                                         "got 'int8'"):
        CacheConfig(kv_cache_dtype="int8")


def test_unknown_kv_cache_dtype_names_the_choices(tiny_ckpt):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*fp8_e4m3"):
        LLM(str(tiny_ckpt[0]), kv_cache_dtype="int4", precompile=False, **ENGINE_ARGS)


def test_a_kernel_table_is_read_at_load_and_a_bad_one_named(tiny_ckpt, tmp_path):
    with pytest.raises(ValueError, match="kernel_table: .*none.json' is not a file"):
        LLM(str(tiny_ckpt[0]), kernel_table=str(tmp_path / "none.json"), precompile=False,
            **ENGINE_ARGS)
    table = tmp_path / "kernel_table.json"
    table.write_text('{"grouped_matmul": {"64": "xla", "4096": "mosaic"}}')
    llm = LLM(str(tiny_ckpt[0]), kernel_table=str(table), precompile=False, **ENGINE_ARGS)
    assert llm.llm_engine.model.runtime.kernel_table.to_dict() == {
        "grouped_matmul": {"64": "xla", "4096": "mosaic"}}


def run_engine(engine, requests, steps=None):
    """Adds (request_id, prompt, params) to `engine` and steps it until they finish;
    returns each request's outputs in order (and appends each step's stats to `steps`)."""
    outputs = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
        if steps is not None and engine.last_step:
            steps.append(engine.last_step)
    return outputs


def joined_deltas(outputs, index):
    """One sample's DELTA outputs added up, checking each holds only what is new."""
    parts = [c for out in outputs for c in out.outputs if c.index == index]
    assert all(c.finish_reason is None for c in parts[:-1]) and parts[-1].finish_reason
    logprobs = None if parts[0].logprobs is None else [e for c in parts for e in c.logprobs]
    return ("".join(c.text for c in parts), [t for c in parts for t in c.token_ids],
            logprobs, parts[-1])


@pytest.mark.parametrize("case", ["stop_string", "n2_logprobs", "prompt_logprobs"])
def test_delta_outputs_add_up_to_the_cumulative_ones(tok_llm, case):
    engine = tok_llm.llm_engine
    tok = tok_llm.get_tokenizer()
    prompt = ids_prompt(tok.encode("Once upon a time"))
    if case == "stop_string":  # 2 characters of a token and 2 of the next: once the
        # first token is out, the text ends in the stop's first half, which waits
        free = tok_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24,
                                                       ignore_eos=True))[0].outputs[0]
        ends = np.cumsum([len(tok.decode(free.token_ids[:i + 1])) for i in range(24)])
        stop = next(free.text[e - 2:e + 2] for e in ends[3:] if free.text[e - 2:e + 2]
                    .isprintable() and free.text.find(free.text[e - 2:e + 2]) == e - 2)
        kwargs = dict(temperature=0.0, max_tokens=24, stop=[stop], logprobs=0)
    elif case == "n2_logprobs":
        kwargs = dict(n=2, temperature=1.0, seed=7, max_tokens=12, logprobs=2)
    else:
        kwargs = dict(temperature=0.0, max_tokens=5, prompt_logprobs=1)
    outs = run_engine(engine, [
        ("cumulative", prompt, SamplingParams(**kwargs)),
        ("delta", prompt, SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA))])
    cumulative, delta = outs["cumulative"], outs["delta"]
    assert len(delta) >= 3 and delta[-1].finished and not any(o.finished for o in delta[:-1])
    for final in cumulative[-1].outputs:
        text, token_ids, logprobs, last = joined_deltas(delta, final.index)
        assert (text, token_ids, logprobs) == (final.text, final.token_ids, final.logprobs)
        assert last.cumulative_logprob == final.cumulative_logprob
        assert (last.finish_reason, last.stop_reason) == (final.finish_reason,
                                                           final.stop_reason)
        streamed = ""  # never text a later token takes back (a stop string's start)
        for out in delta:
            streamed += "".join(c.text for c in out.outputs if c.index == final.index)
            assert final.text.startswith(streamed)
    if case == "stop_string":  # one step's delta stopped short of the cumulative text
        assert cumulative[-1].outputs[0].finish_reason == "stop"
        streamed = np.cumsum([len(o.outputs[0].text) for o in delta])
        assert any(n < len(c.outputs[0].text) for n, c in zip(streamed, cumulative))
    if case == "prompt_logprobs":
        assert delta[0].prompt_logprobs == cumulative[-1].prompt_logprobs
        assert all(o.prompt_logprobs is None for o in delta[1:])
    assert engine.kv_manager.num_free_pages == engine.kv_manager.num_total_pages


def test_final_only_and_aborted_delta_requests(llm):
    engine = llm.llm_engine
    prompt = ids_prompt([5, 6, 7])
    params = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = run_engine(engine, [
        ("final", prompt, SamplingParams(**params, output_kind=RequestOutputKind.FINAL_ONLY)),
        ("cumulative", prompt, SamplingParams(**params))])
    assert len(outs["final"]) == 1 and outs["final"][0].finished
    assert outs["final"][0].outputs == outs["cumulative"][-1].outputs
    engine.add_request("delta", prompt, SamplingParams(**params, output_kind="DELTA"))
    seen = [t for _ in range(3) for out in engine.step() for t in out.outputs[0].token_ids]
    aborted = engine.abort("delta")
    (last,) = aborted.outputs
    assert aborted.finished and last.finish_reason == "abort"
    streamed = seen + last.token_ids
    assert streamed == outs["cumulative"][-1].outputs[0].token_ids[:len(streamed)]
    assert engine.kv_manager.num_free_pages == engine.kv_manager.num_total_pages


@pytest.mark.parametrize("kind, n", [("CUMULATIVE", 1), ("DELTA", 1), ("DELTA", 2)])
def test_stream_interval_sends_the_first_token_then_every_nth_and_the_finish(llm, kind, n):
    engine = llm.llm_engine
    config = engine.scheduler_config
    engine.scheduler_config = dataclasses.replace(config, stream_interval=3)
    steps: list[dict] = []
    try:
        outs = run_engine(engine, [("r", ids_prompt([5, 6, 7]), SamplingParams(
            n=n, temperature=1.0, seed=5, max_tokens=11, ignore_eos=True,
            output_kind=kind))], steps)["r"]
    finally:
        engine.scheduler_config = config
    # the steps' own token stats count every token (the metrics' source), and the prompt once
    assert sum(s["num_generated"] for s in steps) == 11 * n
    assert sum(sum(s["previous_token_times"].values()) for s in steps) == 10 * n
    assert sum(s["num_prompt_tokens"] for s in steps) == 3
    for index in range(n):
        counts = [len(c.token_ids) for o in outs for c in o.outputs if c.index == index]
        if kind == "DELTA":  # new tokens per output
            assert counts == [1, 3, 3, 3, 1]
        else:  # tokens so far
            assert counts == [1, 4, 7, 10, 11]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
