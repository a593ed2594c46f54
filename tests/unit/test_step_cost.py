"""Step FLOPs and bytes against figures worked out by hand for the embedded tiny model
(D=128, 4 layers of which layer 2 is dense with F=256, 4 q / 2 kv heads of 32, 8 experts
top-2 with F=32, vocab 896), and the device peak table."""

from pathlib import Path

import pytest

from qwen_jax.config import ModelConfig
from serving.metrics.step_cost import (
    CostModel,
    StepShape,
    device_peak,
    expected_experts_touched,
)

TINY = ModelConfig.from_hf(Path(__file__).parents[2] / "qwen_jax/assets/tiny-qwen3-moe")
# A decode (1 new token, 10 in context) and a prefill chunk (positions 2-4 of 5).
SHAPE = StepShape(query_lens=(1, 3), context_lens=(10, 5))


def test_the_shape_counts_the_causal_pairs_of_each_chunk():
    # decode: 10 keys; chunk: its tokens at positions 2, 3, 4 see 3 + 4 + 5 keys.
    assert SHAPE.attended_pairs == 10 + 12
    assert SHAPE.num_tokens == 4 and SHAPE.num_seqs == 2
    decodes = StepShape(query_lens=(1, 1, 1), context_lens=(4, 5, 6))
    assert decodes.attended_pairs == 4 + 5 + 6 and decodes.num_tokens == 3


def test_flops_of_a_mixed_step_match_the_hand_count():
    per_layer_attention = (2 * 4 * 128 * (128 + 2 * 64)  # q, k, v projections
                           + 2 * 4 * 128 * 128  # o projection
                           + 4 * 128 * 22)  # scores and values over 22 (query, key) pairs
    assert per_layer_attention == 404_480
    dense_mlp = 2 * 4 * 3 * 128 * 256  # gate, up, down of the one dense layer
    moe = 2 * 4 * 128 * 8 + 2 * 4 * 2 * 3 * 128 * 32  # router + 2 experts a token
    lm_head = 2 * 2 * 128 * 896  # one row per sequence
    expected = 4 * per_layer_attention + dense_mlp + 3 * moe + lm_head
    assert expected == 3_477_504
    assert CostModel(TINY, 4, 4).flops(SHAPE) == expected


def test_bytes_count_the_weights_touched_and_the_kv_read_and_written():
    cost = CostModel(TINY, param_bytes=4, kv_bytes=4).cost(SHAPE)
    attention = 128 * 256 + 128 * 128 + 2 * 32 + 2 * 128  # q/k/v/o, q/k norms, layer norms
    experts = 3 * 8 * (1 - 0.75 ** 4) * 3 * 128 * 32  # 5.46875 expected experts a layer
    assert experts == 201_600
    elements = (4 * attention + 3 * 128 * 256 + 3 * 128 * 8 + experts
                + 4 * 128 + 128 + 128 * 896)  # embedding rows, final norm, lm head
    assert elements == 616_192
    assert cost.weight_bytes == 4 * 616_192
    kv_per_token = 2 * 4 * 2 * 32 * 4  # K and V, 4 layers, 2 heads of 32, float32
    assert cost.kv_read_bytes == 15 * kv_per_token == 30_720
    assert cost.kv_write_bytes == 4 * kv_per_token == 8_192
    assert cost.bytes == 2_464_768 + 30_720 + 8_192


def test_known_expert_counts_replace_the_expectation():
    model = CostModel(TINY, 2, 1)
    expected = model.weight_elements(SHAPE)
    counted = model.weight_elements(SHAPE, experts_touched=[2, 4, 8])
    assert expected - counted == (3 * 5.46875 - 14) * 3 * 128 * 32
    with pytest.raises(ValueError, match="experts_touched has 2 counts; the model has 3"):
        model.weight_elements(SHAPE, experts_touched=[2, 4])


def test_every_weight_is_counted_once_when_every_expert_and_row_is_touched():
    from qwen_jax.planner import param_count
    shape = StepShape(query_lens=(1,), context_lens=(1,))
    all_experts = [TINY.num_experts] * 3
    elements = CostModel(TINY, 4, 4).weight_elements(shape, experts_touched=all_experts)
    # The step gathers one embedding row; the whole table is V rows.
    assert elements - 128 + 896 * 128 == param_count(TINY)


def test_expected_experts_is_exact_at_the_ends():
    assert expected_experts_touched(1, 128, 8) == pytest.approx(8)
    assert expected_experts_touched(10_000, 128, 8) == pytest.approx(128)
    assert expected_experts_touched(0, 128, 8) == 0.0
    assert expected_experts_touched(5, 0, 0) == 0.0


@pytest.mark.parametrize("query_lens,context_lens,message", [
    ((1,), (1, 2), "one each per sequence"),
    ((3,), (2,), "query_len=3 and context_len=2"),
    ((0,), (4,), "query_len=0"),
    ((1, 4), (3, 3), "query_len=4 and context_len=3"),  # the bad chunk, not the first
    ((1, 0), (3, 3), "query_len=0 and context_len=3"),
])
def test_a_shape_that_cannot_happen_is_refused(query_lens, context_lens, message):
    with pytest.raises(ValueError, match=message):
        StepShape(query_lens=query_lens, context_lens=context_lens)


@pytest.mark.parametrize("kind,name,bf16,bandwidth", [
    ("NVIDIA H200", "H200", 989e12, 4.8e12),
    ("NVIDIA GH200 480GB", "GH200 (96 GB HBM3)", 989e12, 4.0e12),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12, 3.35e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12, 2.0e12),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM 80 GB", 312e12, 2.039e12),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM 40 GB", 312e12, 1.555e12),
    ("NVIDIA L40S", "L40S", 362e12, 0.864e12),
])
def test_peaks_are_found_by_device_kind(kind, name, bf16, bandwidth):
    peak = device_peak(kind)
    assert (peak.name, peak.bf16_flops, peak.memory_bytes_per_s) == (name, bf16, bandwidth)
    assert peak.flops(2) == bf16 and peak.flops(4) == peak.tf32_flops < bf16


def test_a_cpu_has_no_peak():
    assert device_peak("cpu") is None


@pytest.mark.parametrize("method, per_weight", [("fp8", 1 + 4 / (128 * 128)), ("int8", 1.0),
                                                ("awq", 0.5 + 3 / 128)])
def test_quantised_projections_and_experts_count_their_stored_bytes(method, per_weight):
    import dataclasses

    from qwen_jax.quantization import Quantization
    quantised = dataclasses.replace(TINY, quantization=Quantization(method=method))
    linear = 4 * (128 * 256 + 128 * 128) + 3 * 128 * 256 + 201_600  # projections, MLP, experts
    other = 616_192 - linear  # norms, router, embedding rows, lm head: still bf16
    cost = CostModel(quantised, param_bytes=2, kv_bytes=2).cost(SHAPE)
    assert cost.weight_bytes == pytest.approx(linear * per_weight + other * 2)
    assert CostModel(TINY, 2, 2).cost(SHAPE).weight_bytes == 2 * 616_192
