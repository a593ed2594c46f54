"""AsyncLLM: streaming from the background engine thread, concurrency, abort frees pages;
with the serial and the overlapped engine loop."""

import asyncio

import pytest

from qwen_jax import AsyncLLM, SamplingParams
from tests.engine.conftest import make_prompts

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
            token_buckets=[8, 64], seq_buckets=[4, 8], show_progress=False)


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlapped"])
def async_llm(tiny_ckpt, compile_cache, request):
    llm = AsyncLLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
                   async_scheduling=request.param, **ARGS)
    yield llm
    llm.shutdown()


async def collect(llm, prompt, params, request_id=None):
    outputs = [out async for out in llm.generate({"prompt_token_ids": prompt}, params,
                                                  request_id=request_id)]
    return outputs


async def test_streams_grow_token_by_token_and_end_finished(async_llm):
    outs = await collect(async_llm, [4, 5, 6], SamplingParams(temperature=0, max_tokens=6,
                                                              ignore_eos=True))
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == sorted(lengths) and lengths[-1] == 6 and len(outs) >= 2
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])


async def test_concurrent_requests_get_what_they_get_alone(async_llm, tiny_ckpt, compile_cache):
    prompts = make_prompts([3, 40, 17, 9, 25], seed=21)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = await asyncio.gather(*(collect(async_llm, p, params) for p in prompts))
    together = [r[-1].outputs[0].token_ids for r in results]
    alone = [(await collect(async_llm, p, params))[-1].outputs[0].token_ids for p in prompts]
    assert together == alone


async def test_a_steps_outputs_reach_the_event_loop_in_one_call(async_llm):
    """The engine thread hands each step's outputs to the loop at once (not one
    thread-safe call per output), and every stream still gets each of its outputs in order."""
    from serving.engine import async_llm as module
    loop = asyncio.get_running_loop()
    batches: list[list] = []
    original = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        if callback is module._put_all:
            batches.append([output.request_id for _, output in args[0]])
        return original(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counting
    try:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        prompts = make_prompts([5, 6, 7, 8], seed=4)
        results = await asyncio.gather(*(collect(async_llm, p, params, request_id=f"b{i}")
                                         for i, p in enumerate(prompts)))
    finally:
        del loop.call_soon_threadsafe
    for i, outs in enumerate(results):  # (a reader behind gets the latest of what waits)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 8
        assert sum(batch.count(f"b{i}") for batch in batches) == 8
    assert any(len(batch) == 4 for batch in batches)  # the four decode together
    assert len(batches) < 4 * 8


@pytest.mark.parametrize("kind", ["DELTA", "CUMULATIVE"])
async def test_a_reader_that_fell_behind_gets_what_waits_as_one_output(async_llm, kind):
    """vLLM's collector: outputs that arrived while the reader was away come as one, DELTA
    ones added up and a CUMULATIVE one the latest; the same tokens and text as a reader
    that kept up."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=kind)
    kept_up = await collect(async_llm, [9, 8, 7], params)
    gen = async_llm.generate({"prompt_token_ids": [9, 8, 7]}, params, request_id=f"behind-{kind}")
    first = await gen.__anext__()
    assert await async_llm.wait_until_idle(30)  # every other token waits in the queue
    rest = [out async for out in gen]
    assert 1 <= len(first.outputs[0].token_ids) < 12 and len(rest) == 1 and rest[0].finished
    if kind == "DELTA":
        ids = first.outputs[0].token_ids + rest[0].outputs[0].token_ids
        text = first.outputs[0].text + rest[0].outputs[0].text
        want_ids = [t for o in kept_up for t in o.outputs[0].token_ids]
        want_text = "".join(o.outputs[0].text for o in kept_up)
    else:
        ids, text = rest[0].outputs[0].token_ids, rest[0].outputs[0].text
        want_ids, want_text = kept_up[-1].outputs[0].token_ids, kept_up[-1].outputs[0].text
    assert (ids, text) == (want_ids, want_text) and len(ids) == 12
    assert rest[0].outputs[0].finish_reason == "length"


async def test_leaving_the_stream_early_aborts_and_frees_pages(async_llm):
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    gen = async_llm.generate({"prompt_token_ids": [7] * 30}, params, request_id="early")
    async for out in gen:
        if len(out.outputs[0].token_ids) >= 2:
            break
    await gen.aclose()
    for _ in range(100):
        stats = async_llm.stats()
        if stats["num_running"] == 0 and stats["num_free_pages"] == stats["num_total_pages"]:
            break
        await asyncio.sleep(0.05)
    assert stats["num_running"] == 0 and stats["num_free_pages"] == stats["num_total_pages"]


async def test_abort_ends_the_stream_with_abort_reason(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    started = asyncio.Event()

    async def consume():
        outs = []
        async for o in async_llm.generate({"prompt_token_ids": [9, 9]}, params,
                                          request_id="to-abort"):
            outs.append(o)
            started.set()
        return outs
    task = asyncio.create_task(consume())
    await started.wait()
    await async_llm.abort("to-abort")
    outs = await asyncio.wait_for(task, 10)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


async def test_bad_request_raises_to_the_caller_and_engine_keeps_serving(async_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(async_llm, [3] * 500, SamplingParams(max_tokens=2))
    outs = await collect(async_llm, [3, 4], SamplingParams(temperature=0, max_tokens=2))
    assert outs[-1].finished


def test_one_async_engine_refuses_data_parallel_and_names_the_client_that_runs_it(tiny_ckpt):
    with pytest.raises(ValueError, match="data_parallel_size=2.*DPAsyncLLM"):
        AsyncLLM(str(tiny_ckpt[0]), data_parallel_size=2, **ARGS)


async def test_a_call_cancelled_before_it_runs_leaves_the_engine_running(async_llm):
    """A client that disconnects while its request waits in the command queue: the engine
    skips the cancelled command (it once died on it, silently)."""
    import threading
    gate = threading.Event()
    blocker = async_llm._call(gate.wait, 10)  # holds the engine thread
    queued = async_llm._call(async_llm.engine.has_unfinished_requests)
    queued.cancel()
    await asyncio.sleep(0.05)  # the cancel reaches the engine's future
    gate.set()
    await blocker
    outs = await asyncio.wait_for(
        collect(async_llm, [3, 4], SamplingParams(temperature=0, max_tokens=2)), 60)
    assert outs[-1].finished and async_llm.dead is None and async_llm._thread.is_alive()
