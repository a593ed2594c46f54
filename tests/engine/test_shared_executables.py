"""Engines of one process share compiled steps (serving/executor/shared_executables.py):
a second engine of the same shapes compiles nothing and still computes with its own
weights; the cache stays within its limit without dropping what engines use."""

import gc

from qwen_jax import LLM, SamplingParams
from serving.executor.shared_executables import (
    REGIONS_PER_EXECUTABLE,
    SHARED,
    SharedExecutables,
)
from tests.engine.conftest import hf_greedy, make_prompts
from tests.helpers.hf import save_hf_model

ARGS = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, token_buckets=[8, 32],
            seq_buckets=[4], show_progress=False)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _step_executables(llm) -> dict:
    return dict(llm.llm_engine.runner._executables)


def test_an_engine_of_the_same_shapes_takes_the_steps_and_keeps_its_weights(tmp_path,
                                                                              compile_cache):
    # Two checkpoints of one configuration, different weights: the second engine takes
    # the first one's executables (the same objects, no compile) and its tokens are its
    # own checkpoint's, as HF gives them.
    fields = dict(moe=True, num_hidden_layers=2, mlp_only_layers=[0], vocab_size=96)
    hf_a = save_hf_model(tmp_path / "a", seed=1, **fields)
    hf_b = save_hf_model(tmp_path / "b", seed=2, **fields)
    prompts = make_prompts([5, 11])
    first = LLM(str(tmp_path / "a"), compilation_cache_dir=compile_cache, **ARGS)
    executables = _step_executables(first)
    del first
    gc.collect()
    hits = SHARED.hits
    second = LLM(str(tmp_path / "b"), compilation_cache_dir=compile_cache, **ARGS)
    assert SHARED.hits - hits == len(executables)
    assert all(second.llm_engine.runner._executables[b] is e for b, e in executables.items())
    outputs = second.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_b, p, 6) for p in prompts]
    assert [hf_greedy(hf_a, p, 6) for p in prompts] != [hf_greedy(hf_b, p, 6) for p in prompts]


def test_other_shapes_compile_their_own(tiny_ckpt, compile_cache):
    first = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache, **ARGS)
    other = LLM(str(tiny_ckpt[0]), compilation_cache_dir=compile_cache,
                **{**ARGS, "max_model_len": 128})  # the step's page table is wider
    shared = set(map(id, _step_executables(first).values()))
    assert not shared & set(map(id, _step_executables(other).values()))


class _Executable:
    """Stands in for a compiled step (weak-referenceable, as jax's are)."""


class _Runner:
    def __init__(self):
        self.executables = []


def _compile(cache: SharedExecutables, runner: _Runner, keys) -> list:
    found, built = cache.compile(runner, keys, lambda i: None,
                                 lambda indices, lowered: [_Executable() for _ in indices])
    runner.executables += found
    return built


def test_the_cache_makes_room_with_what_no_engine_uses():
    cache = SharedExecutables(limit=6, regions=lambda: None)
    live = _Runner()
    assert _compile(cache, live, ["a", "b", "c"]) == [0, 1, 2]
    gone = _Runner()
    assert _compile(cache, gone, ["d", "e"]) == [0, 1]
    del gone
    # 5 alive, 3 more to come: two must go, and only "d" and "e" can (no engine holds them)
    newer = _Runner()
    assert _compile(cache, newer, ["a", "f", "g", "h"]) == [1, 2, 3]  # "a": shared
    assert list(cache._held) == ["b", "c", "a", "f", "g", "h"]
    assert len(cache._alive) == 6
    # past the limit only with what engines hold: nothing of theirs is dropped
    assert _compile(cache, _Runner(), ["i"]) == [0]
    assert set(cache._held) == {"a", "b", "c", "f", "g", "h", "i"}


def test_the_cache_makes_room_for_the_mappings_of_what_comes():
    # Plenty of executables allowed, but the process maps near half its allowance: each
    # executable to come takes REGIONS_PER_EXECUTABLE more, and those held unused go.
    most = 65_530
    used = [0]
    cache = SharedExecutables(limit=100, regions=lambda: (used[0], most))
    _compile(cache, _Runner(), ["a", "b", "c", "d"])  # no engine keeps them
    assert len(cache) == 4
    used[0] = most // 2 - 2 * REGIONS_PER_EXECUTABLE  # room for two executables
    assert _compile(cache, _Runner(), ["a", "e", "f", "g"]) == [1, 2, 3]  # "a": shared
    # three to come, room for two: one of "b", "c", "d" (the oldest) went
    assert list(cache._held) == ["c", "d", "a", "e", "f", "g"]


def test_a_key_that_does_not_hash_is_never_shared():
    cache = SharedExecutables(limit=6, regions=lambda: None)
    runner = _Runner()
    assert _compile(cache, runner, [None, None]) == [0, 1]
    assert len(cache) == 0 and cache.hits == 0


def test_a_limit_of_zero_shares_nothing():
    cache = SharedExecutables(limit=0, regions=lambda: None)
    runner = _Runner()
    _compile(cache, runner, ["a"])
    assert _compile(cache, _Runner(), ["a"]) == [0] and len(cache) == 0
