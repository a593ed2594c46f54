"""The overlapped engine loop (async_scheduling) gives exactly what the serial loop gives:
same tokens, texts and finish reasons in every batching mode, and no page left held.
(Being the default, the overlapped loop also runs every other engine test: HF parity,
the embedded model against its full forward, data-parallel and sharded layouts.)"""

import threading

import jax.numpy as jnp
import pytest

from qwen_jax import LLM, SamplingParams
from serving.engine.config import engine_config_from_kwargs
from serving.engine.llm_engine import LLMEngine
from serving.sample.sampling_arrays import SamplerOutput
from tests.engine.conftest import make_prompts

ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
            token_buckets=[8, 16, 64], seq_buckets=[4, 8], show_progress=False,
            precompile=False)  # only the buckets a test uses compile
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_pair(ckpt, compile_cache, **kwargs):
    """(serial, overlapped) LLMs over the same checkpoint and options."""
    args = {**ARGS, **kwargs, "compilation_cache_dir": compile_cache}
    return (LLM(str(ckpt), async_scheduling=False, **args),
            LLM(str(ckpt), async_scheduling=True, **args))


def results(outs):
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in outs]


def assert_no_leak(llm):
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_pages"] == stats["num_total_pages"]


def assert_same(pair, prompts, params, overlapped=True):
    serial, fast = pair
    before = fast.stats()["num_overlapped_steps"]
    expected = results(serial.generate(prompts, params))
    assert results(fast.generate(prompts, params)) == expected
    steps = fast.stats()["num_overlapped_steps"] - before
    assert steps > 0 if overlapped else steps == 0
    assert serial.stats()["num_overlapped_steps"] == 0
    for llm in pair:
        assert_no_leak(llm)
    return expected


def ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


@pytest.fixture(scope="module")
def pair(tiny_ckpt, compile_cache):
    return make_pair(tiny_ckpt[0], compile_cache)


@pytest.fixture(scope="module")
def tok_pair(tokenizer_ckpt, compile_cache):
    return make_pair(tokenizer_ckpt[0], compile_cache)


def test_plain_batch(pair):
    assert_same(pair, ids(make_prompts([1, 5, 23, 70, 9, 40])), GREEDY)


def test_max_tokens_differ_per_request(pair):
    prompts = ids(make_prompts([4, 9, 30, 2], seed=1))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (1, 2, 7, 13)]
    out = assert_same(pair, prompts, params)
    assert [len(o[0][0]) for o in out] == [1, 2, 7, 13]


def test_chunked_prefill(tiny_ckpt, compile_cache):
    pair = make_pair(tiny_ckpt[0], compile_cache, max_num_seqs=4, max_num_batched_tokens=8,
                     token_buckets=[8], seq_buckets=[4])
    assert_same(pair, ids(make_prompts([30, 3, 19, 45], seed=2)), GREEDY)


def test_tiny_kv_pool_with_preemptions(tiny_ckpt, compile_cache):
    pair = make_pair(tiny_ckpt[0], compile_cache, num_gpu_blocks_override=9)
    assert_same(pair, ids(make_prompts([15, 14, 31, 30, 13], seed=3)), GREEDY)
    assert all(llm.stats()["num_preemptions"] > 0 for llm in pair)


def test_prefix_caching_over_two_passes(pair):
    shared = make_prompts([40], seed=7)[0]
    prompts = ids([shared + tail for tail in make_prompts([3, 17, 1, 22], seed=8)])
    first = assert_same(pair, prompts, GREEDY)
    hits = pair[1].stats()["prefix_cache_hits"]
    assert assert_same(pair, prompts, GREEDY) == first
    assert pair[1].stats()["prefix_cache_hits"] - hits >= 4 * 32  # two full pages each


def test_n_samples_with_seeds(pair):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, top_k=20, seed=11, max_tokens=10,
                            ignore_eos=True)
    out = assert_same(pair, ids(make_prompts([6, 21], seed=4)), params)
    assert len({tuple(c[0]) for c in out[0]}) > 1  # the three samples differ


def test_eos_and_min_tokens(pair):
    # Without ignore_eos, requests stop at EOS (a token that may end a request mid-batch
    # while its next step is already in flight); min_tokens masks it for the first few.
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, min_tokens=m)
              for s, m in zip(range(6), (0, 5, 0, 3, 0, 0))]
    assert_same(pair, ids(make_prompts([3, 8, 2, 12, 5, 7], seed=5)), params)


def test_stop_strings_that_end_mid_step(tok_pair):
    serial, _ = tok_pair
    prompt = "The quick brown fox"
    text = serial.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16,
                                                  ignore_eos=True))[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # ends inside some token, in the middle
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop])
    out = assert_same(tok_pair, [prompt, "Once upon a time"], params)
    assert out[0][0][2] == "stop" and out[0][0][3] == stop


def test_qwen3_recommended_sampling_at_qwens_vocabulary(tok_pair):
    """Seeded n=2 with Qwen3's recommended sampling (the sampler's few-candidates path at
    151,936 tokens), with logprobs and without: the serial loop's tokens and texts."""
    for logprobs in (None, 2):
        params = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=3, n=2,
                                max_tokens=8, ignore_eos=True, logprobs=logprobs)
        assert_same(tok_pair, ["Once upon a time", "The capital of France"], params)


def test_penalties_overlap_with_the_same_output(pair):
    """A penalty row's counts include the token in flight, which the device puts in
    (PENDING_TOKEN): greedy and seeded tokens are the serial loop's."""
    prompts = ids(make_prompts([5, 16, 9], seed=6))
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                            repetition_penalty=1.3, presence_penalty=0.5)
    seeded = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=10, n=2,
                            ignore_eos=True, frequency_penalty=1.5, presence_penalty=-0.5)
    plain = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for params in (greedy, seeded, [greedy, plain, seeded]):
        assert_same(pair, prompts, params)


def test_abort_mid_stream(tiny_ckpt, compile_cache):
    def run(async_scheduling):
        engine = LLMEngine(engine_config_from_kwargs(
            str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
            async_scheduling=async_scheduling, **ARGS))
        for i, p in enumerate(make_prompts([20, 9, 7], seed=9)):
            engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        finished = {}
        for step in range(40):
            if step == 4:
                engine.abort("1")
            for out in engine.step():
                assert out.request_id != "1" or step < 4  # nothing after the abort
                if out.finished:
                    finished[out.request_id] = out.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        stats = engine.stats()
        assert stats["num_free_pages"] == stats["num_total_pages"]
        return finished

    assert run(True) == run(False) and set(run(False)) == {"0", "2"}


def test_dispatch_thread_gives_the_same_tokens(pair, tiny_ckpt, compile_cache):
    # Device calls from the runner's DispatchThread (its default off the CPU): the same
    # tokens as the serial loop (greedy tokens do not depend on the pool), with swaps,
    # which read and replace the caches after every step dispatched before them.
    threaded = LLM(str(tiny_ckpt[0]), async_scheduling=True, num_gpu_blocks_override=9,
                   swap_space=0.01, swap_min_tokens=0,
                   **{**ARGS, "compilation_cache_dir": compile_cache})
    threaded.llm_engine.runner.dispatch_thread = True
    assert_same((pair[0], threaded), ids(make_prompts([15, 14, 31, 30, 13], seed=3)), GREEDY)
    stats = threaded.stats()
    assert stats["num_swap_outs"] > 0 and stats["num_swap_outs"] == stats["num_swap_ins"]


class _BlockingStep:
    """A compiled step that holds its caller as a GPU's does: XLA blocks the calling
    thread at the step's first `lax.cond` until the device gets there. Call k (k >= 2)
    returns once the engine has processed k - 1 steps' tokens, or after `patience`
    seconds; it records which."""

    def __init__(self, engine, patience: float):
        self.patience, self.released = patience, []
        self.processed = 0
        self._changed = threading.Condition()
        process = engine._process_tokens

        def counted(*args, **kwargs):
            outputs = process(*args, **kwargs)
            with self._changed:
                self.processed += 1
                self._changed.notify_all()
            return outputs
        engine._process_tokens = counted
        self.calls = 0

    def get(self, bucket, default=None):  # as runner._executables.get: every bucket
        return self

    def __len__(self):  # runner.num_compiles
        return 0

    def __bool__(self):
        return True

    def __call__(self, state, kv_caches, words, penalties, mask, prev_tokens, score_rows):
        self.calls += 1
        if self.calls >= 2:
            with self._changed:
                self.released.append(self._changed.wait_for(
                    lambda: self.processed >= self.calls - 1, timeout=self.patience))
        tokens = jnp.full(mask.bits.shape[0], 7, jnp.int32)
        return kv_caches, (SamplerOutput(token_ids=tokens, logprobs=None),
                           jnp.zeros(prev_tokens.shape, jnp.int32).at[:tokens.shape[0]].set(7))


@pytest.mark.parametrize("dispatch_thread", [True, False])
def test_host_work_overlaps_a_step_call_that_blocks(tiny_ckpt, dispatch_thread):
    # With the dispatch thread the engine processes step k-1's tokens while the call of
    # step k is held (as on a GPU); without it the engine's own thread is held, so every
    # call waits out its patience (the control: the test tells the two apart).
    llm = LLM(str(tiny_ckpt[0]), async_scheduling=True, **ARGS)
    engine = llm.llm_engine
    engine.runner.dispatch_thread = dispatch_thread
    step = _BlockingStep(engine, patience=20.0 if dispatch_thread else 0.2)
    engine.runner._executables = step
    out = llm.generate(ids(make_prompts([5, 9], seed=1)), SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in out] == [[7] * 6] * 2
    assert len(step.released) >= 5
    assert all(step.released) if dispatch_thread else not any(step.released)
    assert_no_leak(llm)


class _LostDevice(_BlockingStep):
    """A compiled step whose every call fails, as a lost device's would."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        raise RuntimeError("device lost")


@pytest.mark.parametrize("dispatch_thread", [True, False])
def test_a_failed_step_call_raises_from_generate(tiny_ckpt, dispatch_thread):
    # From the dispatch thread the call's error reaches the engine's caller (raised where
    # the step is read rather than where it is dispatched) as it does from the engine's
    # thread, and the dispatch thread lives on for the calls after it.
    llm = LLM(str(tiny_ckpt[0]), async_scheduling=True, **ARGS)
    runner = llm.llm_engine.runner
    runner.dispatch_thread = dispatch_thread
    runner._executables = lost = _LostDevice()
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(ids(make_prompts([5], seed=2)), GREEDY)
    assert lost.calls == 1
    if dispatch_thread:
        assert runner._dispatch_thread._thread.is_alive()
        assert runner._dispatch_thread.call(lambda: 42) == 42
