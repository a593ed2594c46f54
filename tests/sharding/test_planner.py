"""The memory planner, from abstract shapes only (no device memory is allocated)."""

import jax
import pytest

from qwen_jax.config import ModelConfig
from qwen_jax.planner import plan_memory, weight_bytes_per_device
from serving.cli.main import main

H200 = 141e9


def test_235b_bf16_fits_on_8_h200_with_its_kv_capacity():
    plan = plan_memory(ModelConfig.from_hf("qwen3-235b-a22b"), dtype="bfloat16",
                       tensor_parallel_size=8, device_memory_bytes=H200)
    # 235 B params x 2 bytes / 8 devices, plus the replicated norms and router.
    assert 58e9 < plan.weight_bytes_per_device < 61e9
    # 94 layers x 16 tokens x one kv head (4 heads over TP 8: one copy each) x 128 x 2 x 2 B
    assert plan.kv_bytes_per_page_per_device == 2 * 94 * 16 * 1 * 128 * 2
    assert plan.max_concurrent_tokens > 1_000_000
    assert plan.num_pages == (plan.usable_bytes - plan.weight_bytes_per_device) // \
        plan.kv_bytes_per_page_per_device


def test_30b_on_one_h200_reports_kv_capacity():
    plan = plan_memory(ModelConfig.from_hf("qwen3-30b-a3b"), dtype="bfloat16",
                       device_memory_bytes=H200)
    assert 60e9 < plan.weight_bytes_per_device < 62e9  # 30.5 B x 2 bytes
    assert plan.kv_bytes_per_page_per_device == 16 * 96 * 1024  # 96 KiB per token
    assert 600_000 < plan.max_concurrent_tokens < 700_000


def test_235b_bf16_on_one_h200_is_refused_with_the_numbers():
    with pytest.raises(ValueError, match=r"470\.\d GB per device.*tensor_parallel_size=1"):
        plan_memory(ModelConfig.from_hf("qwen3-235b-a22b"), dtype="bfloat16",
                    device_memory_bytes=H200)


def test_expert_parallel_divides_expert_weights():
    cfg = ModelConfig.from_hf("qwen3-30b-a3b")
    one = weight_bytes_per_device(cfg, "bfloat16", 1, 1)
    ep8 = weight_bytes_per_device(cfg, "bfloat16", 1, 8)
    # Experts are ~95% of the bytes: EP=8 leaves 1/8 of them plus the replicated rest.
    assert ep8 < one / 5


def test_planning_allocates_no_device_memory():
    before = {id(x) for x in jax.live_arrays()}
    plan_memory(ModelConfig.from_hf("qwen3-235b-a22b"), tensor_parallel_size=8,
                device_memory_bytes=H200)
    new = [x for x in jax.live_arrays() if id(x) not in before]
    assert sum(x.nbytes for x in new) < 1 << 20


def test_plan_command_prints_and_refuses(capsys):
    assert main(["plan", "--model", "qwen3-30b-a3b"]) == 0
    assert "tokens" in capsys.readouterr().out
    assert main(["plan", "--model", "qwen3-235b-a22b"]) == 1
    assert "cannot fit" in capsys.readouterr().err


def test_lora_slots_are_counted_per_device_beside_the_weights(capsys):
    # 30B, 8 slots at rank 16, bf16, per layer and slot: each of 128 experts holds gate/up
    # A [2048, 2r] and block-diagonal B [2r, 2 x 768], down A [768, r] and B [r, 2048]
    # (159,744 values); attention q/k/v A [2048, 3r] and B [3r, 4096 + 2 x 512], o A
    # [4096, r] and B [r, 2048] (442,368); the router A [2048, r] and B [r, 128].
    cfg = ModelConfig.from_hf("qwen3-30b-a3b")
    experts, attention, router = 128 * 159_744, 442_368, 2048 * 16 + 16 * 128
    per_slot = 48 * (experts + attention + router) * 2
    one = plan_memory(cfg, device_memory_bytes=H200)
    tp1 = plan_memory(cfg, device_memory_bytes=H200, max_loras=8, max_lora_rank=16)
    assert tp1.lora_bytes_per_device == 8 * per_slot              # 16.07 GB
    assert tp1.weight_bytes_per_device == one.weight_bytes_per_device
    assert tp1.num_pages == (tp1.usable_bytes - tp1.weight_bytes_per_device
                             - tp1.lora_bytes_per_device) // tp1.kv_bytes_per_page_per_device
    ep8 = plan_memory(cfg, device_memory_bytes=H200, expert_parallel_size=8, max_loras=8)
    # the experts' factors split over the 8 expert shards, the rest replicated
    assert ep8.lora_bytes_per_device == 8 * 48 * (experts // 8 + attention + router) * 2
    assert main(["plan", "--model", "qwen3-30b-a3b", "--max-loras", "8"]) == 0
    assert "LoRA slots 16.07 GB/device" in capsys.readouterr().out


def test_235b_fp8_on_4_h200_fits_with_the_quantised_bytes():
    bf16 = weight_bytes_per_device(ModelConfig.from_hf("qwen3-235b-a22b"), "bfloat16", 4, 1)
    plan = plan_memory(ModelConfig.from_hf("qwen3-235b-a22b"), dtype="bfloat16",
                       tensor_parallel_size=4, device_memory_bytes=H200, quantization="fp8")
    # fp8 experts and projections (1 byte + a float32 scale per 128 x 128 block), bf16 rest
    assert 0.49 * bf16 < plan.weight_bytes_per_device < 0.52 * bf16
    assert plan.max_concurrent_tokens > 1_000_000
    assert main(["plan", "--model", "qwen3-235b-a22b", "--quantization", "fp8", "-tp", "4"]) == 0


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-0.6b"])
@pytest.mark.parametrize("quantization,fraction", [("fp8", 0.52), ("int8", 0.52),
                                                   ("awq", 0.30)])
def test_every_preset_plans_in_every_format(preset, quantization, fraction):
    cfg = ModelConfig.from_hf(preset)
    tp = 4 if preset == "qwen3-235b-a22b" else 1  # 8 would cut 128-blocks of F = 1536
    bf16 = weight_bytes_per_device(cfg, "bfloat16", tp, 1)
    plan = plan_memory(cfg, tensor_parallel_size=tp, device_memory_bytes=H200,
                       quantization=quantization)
    assert plan.weight_bytes_per_device < fraction * bf16 or preset == "qwen3-0.6b"
    assert plan.weights == f"{quantization}, rest bfloat16"


def test_plan_refuses_a_split_inside_fp8_blocks_naming_it(capsys):
    # Qwen3-30B-A3B's expert FFN of 768 over TP=4: 192-wide shards, not whole 128-blocks
    # (vLLM refuses it too); expert parallelism splits the experts instead.
    assert main(["plan", "--model", "qwen3-30b-a3b", "-q", "fp8", "-tp", "4"]) == 1
    err = capsys.readouterr().err
    assert "model.layers.0-47.mlp.experts.*" in err and "tensor_parallel_size=4" in err
    assert "768 into 192-wide shards" in err and "block of 128" in err
    assert main(["plan", "--model", "qwen3-30b-a3b", "-q", "fp8", "-ep", "4"]) == 0


def test_pipeline_stages_hold_their_share_of_layers_kv_and_vocab(capsys):
    from qwen_jax.planner import kv_bytes_per_page
    cfg = ModelConfig.from_hf("qwen3-235b-a22b")  # 94 layers: PP 2, not 4
    tp8 = weight_bytes_per_device(cfg, "bfloat16", 8, 1)
    pp2_tp4 = weight_bytes_per_device(cfg, "bfloat16", 4, 1, 2)
    # the layers split over stages, the embeddings and lm head over stages x TP, as TP8
    # splits them; what TP8 replicates is less under PP2 x TP4: the norms and routers (half
    # the layers a stage) and k/v_proj (4 KV heads: whole on every device at TP8)
    assert 0 < tp8 - pp2_tp4 < 0.02 * tp8
    plan = plan_memory(cfg, tensor_parallel_size=4, pipeline_parallel_size=2,
                       device_memory_bytes=H200)
    assert plan.weight_bytes_per_device == pp2_tp4
    # a stage's 47 layers, K / TP = one head each (TP8: one replicated copy of 4 heads)
    assert plan.kv_bytes_per_page_per_device == kv_bytes_per_page(cfg, 16, "bfloat16", 4) // 2
    assert plan.num_pages == (plan.usable_bytes - pp2_tp4) // plan.kv_bytes_per_page_per_device
    assert main(["plan", "--model", "qwen3-235b-a22b", "-tp", "4", "-pp", "2"]) == 0
    assert "PP=2 x TP=4 x EP=1" in capsys.readouterr().out
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 must divide the 94 "
                                         "consecutive moe layers from layer 0"):
        plan_memory(cfg, tensor_parallel_size=2, pipeline_parallel_size=4,
                    device_memory_bytes=H200)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 x tensor_parallel_size=1"):
        plan_memory(cfg, pipeline_parallel_size=2, device_memory_bytes=H200)
