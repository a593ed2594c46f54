"""The whole serving step (forward + sampling), lowered for CUDA on a CPU machine at real
model shapes with abstract params (no weight allocated, no GPU): every weight is read in
place by a kernel, the layer body stays under its heavy-op ceiling, fp8 caches lower."""

import pytest

from pallas_kernels.choices import KernelTable
from pallas_kernels.mosaic_support import attention_unsupported_reason
from serving.executor import step_lowering

# Batch-1 decode (attention split across programs), 64 decodes, a 2k-token prefill.
BUCKETS = [(8, 4), (64, 64), (2048, 64)]
# Heavy ops (custom calls, dots, gathers, scatters, sorts, loops, reductions, dynamic
# slices, top-k, cumulative sums) in one layer of Qwen3-30B-A3B: 18, and 19 where the
# attention splits (its combine). docs/benchmarks.md, "Step op counts", itemises them.
PER_LAYER_CEILING = 19


@pytest.fixture(scope="module")
def runner():
    return step_lowering.abstract_runner("qwen3-30b-a3b", impl="pallas")


def _check_weights_read_whole(reads):
    assert reads["sliced_reads"] == []
    matrices = {w for w in reads["weights"] if len(w[0]) >= 3}
    assert matrices and matrices <= set(reads["whole"])
    for weight, consumers in reads["consumers"].items():
        # Matrices go whole into kernels (a reshape is a view); the per-layer vectors
        # (norm weights) are concatenated into one table once per step.
        allowed = {"custom_call", "reshape", "while"} if len(weight[0]) >= 3 else {"concatenate"}
        assert set(consumers) <= allowed, (weight, consumers)


@pytest.mark.parametrize("bucket", BUCKETS)
def test_every_weight_is_read_whole_by_a_kernel(runner, bucket):
    _check_weights_read_whole(step_lowering.weight_reads(runner, bucket))


def test_dense_mlp_weights_too():
    dense = step_lowering.abstract_runner("qwen3-0.6b", impl="pallas", max_model_len=512)
    _check_weights_read_whole(step_lowering.weight_reads(dense, (64, 8)))


def test_the_check_sees_per_layer_slices_where_they_exist():
    # The reference path slices w[layer] for XLA dots: exactly what the check refuses.
    reads = step_lowering.weight_reads(step_lowering.abstract_runner(impl="reference"), (8, 4))
    assert reads["sliced_reads"] and not reads["whole"]
    assert {op for op, _, _ in reads["sliced_reads"]} == {"stablehlo.dot_general"}


@pytest.mark.parametrize("bucket", BUCKETS)
def test_heavy_ops_per_layer_stay_under_the_ceiling(runner, bucket):
    summary = step_lowering.summary(runner, bucket)
    assert summary["layers_per_segment"] == [48]
    assert summary["per_layer_heavy"][0] <= PER_LAYER_CEILING, summary
    by_op = summary["per_layer_heavy_by_op"][0]
    # No search loops, no gathered or scattered token copies, no XLA matmuls.
    for kind in ("while", "gather", "dot_general"):
        assert kind not in by_op, summary
    # qkv, attention (+ combine when split), o_proj, router, gate/up, down
    assert by_op["custom_call"] == (7 if bucket == (8, 4) else 6)


@pytest.mark.parametrize("kv_cache_dtype,stored", [("fp8", "f8E4M3FN"), ("fp8_e5m2", "f8E5M2")])
def test_fp8_cache_step_lowers_with_the_kernels(kv_cache_dtype, stored):
    fp8 = step_lowering.abstract_runner(impl="pallas", kv_cache_dtype=kv_cache_dtype)
    text = step_lowering.lower_step(fp8, (8, 4)).as_text()
    assert f"tensor<249600x16x4x128x{stored}>" in text  # the donated cache
    assert text.count("xla.gpu.triton(") == 7
    _check_weights_read_whole(step_lowering.weight_reads(fp8, (8, 4)))


@pytest.mark.parametrize("quantization,stored", [
    ("fp8", "float8_e4m3fn"), ("int8", "int8"), ("awq", "uint8")])
def test_quantized_weights_enter_the_kernels_whole(quantization, stored):
    # Qwen3-30B-A3B with every projection and expert quantised as that format's checkpoint
    # holds them: the stored values, scales and zero points reach the kernels whole (no
    # per-layer slice, no dequantised copy), and the layer keeps its op count.
    runner = step_lowering.abstract_runner("qwen3-30b-a3b", impl="pallas",
                                           quantization=quantization)
    reads = step_lowering.weight_reads(runner, (8, 4))
    _check_weights_read_whole(reads)
    quantized = {w for w in reads["whole"] if w[1] == stored}
    assert {(48, 128, 2048 // (2 if stored == "uint8" else 1), 2, 768),
            (48, 128, 768 // (2 if stored == "uint8" else 1), 2048)} <= {w[0] for w in quantized}
    assert any(w[0][:3] == (48, 128, 16 if quantization != "int8" else 1) for w in reads["whole"])
    summary = step_lowering.summary(runner, (8, 4))
    assert summary["per_layer_heavy"][0] <= PER_LAYER_CEILING, summary
    assert "dot_general" not in summary["per_layer_heavy_by_op"][0]


def test_runtime_conditionals_are_the_samplers_and_fewer_for_cuda(runner):
    # On a GPU each conditional a step runs reads its predicate back to the host (the
    # dispatch thread waits there, the device's queue drains): none in the layers; the
    # step's are the sampler's, whose one-or-two-pass branches run behind selects there.
    summary = step_lowering.summary(runner, (8, 4))
    assert summary["per_layer_conditionals"] == [0]
    cuda = step_lowering.sampler_summary(4, 151936, 1280)["conditionals"]
    cpu = step_lowering.sampler_summary(4, 151936, 1280, platforms=("cpu",))["conditionals"]
    assert summary["outside_conditionals"] == cuda
    assert cuda <= cpu - 5


def test_a_kernel_table_puts_mosaic_kernels_in_the_prefill_step_only():
    # The probe's table as it might come out: Triton at decode sizes, Mosaic GPU at prefill.
    table = KernelTable.from_dict({
        "grouped_matmul": {"64": "pallas", "16384": "mosaic"},
        "ragged_paged_attention": {"8": "pallas", "2048": "mosaic"}})
    runner = step_lowering.abstract_runner(impl="pallas", kernel_table=table)
    decode = step_lowering.lower_step(runner, (8, 4)).as_text()
    assert "mosaic_gpu" not in decode and decode.count("xla.gpu.triton(") == 7
    prefill = step_lowering.lower_step(runner, (2048, 64)).as_text()
    # gate/up and down, and attention where this jax offers the Mosaic GPU one
    mosaic_calls = 2 if attention_unsupported_reason() else 3
    assert prefill.count("@mosaic_gpu") == mosaic_calls, prefill.count("mosaic_gpu")
    assert prefill.count("xla.gpu.triton(") == 6 - mosaic_calls
    _check_weights_read_whole(step_lowering.weight_reads(runner, (2048, 64)))



@pytest.mark.parametrize("bucket", [(8, 4), (2048, 64)])
def test_lora_adds_its_grouped_matmuls_and_no_loop_per_adapter(runner, bucket):
    # 8 rank-16 adapter slots: per layer a shrink and an expand grouped matmul each for
    # qkv, o_proj, the experts' gate/up and down (8 kernels, whatever the adapters mixed
    # in the batch), the router's update as two XLA dots, and no loop over adapters.
    lora = step_lowering.abstract_runner("qwen3-30b-a3b", impl="pallas", max_loras=8)
    base = step_lowering.summary(runner, bucket)["per_layer_heavy_by_op"][0]
    by_op = step_lowering.summary(lora, bucket)["per_layer_heavy_by_op"][0]
    assert by_op["custom_call"] == base["custom_call"] + 8, by_op
    assert by_op.get("dot_general", 0) == 2 and "while" not in by_op, by_op
