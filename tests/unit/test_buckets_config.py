"""Bucket sizes and engine config validation."""

import pytest

from serving.core.buckets import (
    bucket_pairs,
    make_buckets,
    make_token_buckets,
    pick_bucket,
    pick_seq_bucket,
)
from serving.core.config import CacheConfig, SchedulerConfig


def test_make_buckets_powers_of_two_with_limit_included():
    assert make_buckets(512, minimum=8) == [8, 16, 32, 64, 128, 256, 512]
    assert make_buckets(100, minimum=8) == [8, 16, 32, 64, 100]
    assert make_buckets(6, minimum=4) == [4, 6]
    assert make_buckets(3, minimum=8) == [3]
    assert make_buckets(20, minimum=5) == [8, 16, 20]


def test_pick_bucket_smallest_that_fits():
    buckets = [8, 16, 32, 100]
    assert pick_bucket(1, buckets) == 8
    assert pick_bucket(8, buckets) == 8
    assert pick_bucket(9, buckets) == 16
    assert pick_bucket(100, buckets) == 100
    with pytest.raises(ValueError, match="101 exceeds the largest bucket 100"):
        pick_bucket(101, buckets)


def test_token_buckets_double_then_grow_by_half_steps():
    assert make_token_buckets(2048) == [8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024,
                                        1536, 2048]
    assert make_token_buckets(512) == [8, 16, 32, 64, 128, 192, 256, 384, 512]
    assert make_token_buckets(300) == [8, 16, 32, 64, 128, 192, 256, 300]
    assert make_token_buckets(64) == [8, 16, 32, 64]
    # no prefill-sized step pads by more than a third
    buckets = make_token_buckets(2048)
    assert max(1 - (n + 1) / pick_bucket(n + 1, buckets) for n in range(128, 2048)) < 1 / 3


@pytest.mark.parametrize("tokens,seqs", [([8, 12], [4, 8, 16]),
                                         ([8, 64, 256, 384, 2048], [4, 8, 16, 32, 64])])
def test_bucket_pairs_cover_every_feasible_step(tokens, seqs):
    pairs = set(bucket_pairs(tokens, seqs))
    for num_tokens in range(1, tokens[-1] + 1, 7):
        t = pick_bucket(num_tokens, tokens)
        for num_seqs in range(1, min(num_tokens, seqs[-1]) + 1):
            assert (t, pick_seq_bucket(t, num_seqs, seqs)) in pairs
    assert (8, 16) not in pairs


def test_large_token_buckets_compile_one_sequence_bucket():
    pairs = bucket_pairs(make_token_buckets(2048), [4, 8, 16, 32, 64])
    assert [s for t, s in pairs if t >= 256] == [64] * 7
    assert pick_seq_bucket(384, 2, [4, 8, 16, 32, 64]) == 64
    assert pick_seq_bucket(128, 2, [4, 8, 16, 32, 64]) == 4
    assert len(pairs) == 31  # 39 with powers of two and every pair


def test_scheduler_config_default_buckets():
    c = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)
    assert c.token_bucket_sizes == (8, 16, 32, 64, 128, 192, 256, 384, 512)
    assert c.seq_bucket_sizes == (4, 8, 16, 32, 64)
    assert c.pages_per_seq(16) == 128


def test_scheduler_config_max_model_len_defaults_to_unresolved():
    c = SchedulerConfig()
    assert c.max_model_len is None  # the engine takes the model's (capped)
    with pytest.raises(ValueError, match="max_model_len is not resolved"):
        c.pages_per_seq(16)


def test_scheduler_config_custom_buckets_sorted_and_must_reach_limit():
    c = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(64, 16))
    assert c.token_bucket_sizes == (16, 64)
    with pytest.raises(ValueError, match="token_buckets must include a bucket >= "
                                         "max_num_batched_tokens=64, got max 32"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, token_buckets=(16, 32))


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), "max_num_seqs must be >= 1, got 0"),
    (dict(max_num_seqs=64, max_num_batched_tokens=32),
     "max_num_batched_tokens must be >= max_num_seqs=64, got 32"),
    (dict(watermark=1.0), "watermark must be in [0, 1), got 1.0"),
    (dict(policy="lifo"), "policy must be one of ('fcfs', 'priority', 'length-aware'), got 'lifo'"),
    (dict(max_waiting=0), "max_waiting must be >= 1 or None, got 0"),
    (dict(stream_interval=0), "stream_interval must be an int >= 1 (tokens), got 0"),
    (dict(stream_interval=2.5), "stream_interval must be an int >= 1 (tokens), got 2.5"),
])
def test_scheduler_config_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        SchedulerConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=12), "block_size must be a power of two >= 1, got 12"),
    (dict(num_gpu_blocks_override=1), "num_gpu_blocks_override must be >= 2"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization must be in (0, 1], got 0"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype must be one of"),
    (dict(swap_space=-1), "swap_space must be >= 0, got -1"),
])
def test_cache_config_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        CacheConfig(**kwargs)
    assert message in str(info.value)


def test_configs_are_frozen_and_keyword_only():
    c = CacheConfig()
    with pytest.raises(AttributeError):
        c.block_size = 32
    with pytest.raises(TypeError):
        CacheConfig(16)


def test_a_none_compilation_cache_dir_turns_the_cache_off_and_unset_keeps_the_default():
    from serving.engine.config import engine_config_from_kwargs
    assert engine_config_from_kwargs(compilation_cache_dir=None).compilation_cache_dir is None
    assert engine_config_from_kwargs().compilation_cache_dir == "default"
    # other names' None means not given (the CLI passes unset options as None)
    assert engine_config_from_kwargs(max_num_seqs=None).scheduler.max_num_seqs == 64
