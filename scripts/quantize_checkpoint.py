"""Quantise an HF Qwen3 / Qwen3-MoE float checkpoint into a quantised checkpoint laid out
exactly as the real tools write it (for tests and for trying the formats on small models):

    python scripts/quantize_checkpoint.py --model qwen_jax/assets/tiny-qwen3-moe \\
        --format fp8 --output /tmp/tiny-fp8 [--block-size 128]
    python scripts/quantize_checkpoint.py --model ... --format awq --output /tmp/tiny-awq \\
        [--group-size 32]

fp8 (Qwen's Qwen3-*-FP8 checkpoints): every q/k/v/o projection, dense MLP projection and
expert projection becomes `weight` float8_e4m3fn [out, in] plus `weight_scale_inv` float32
[ceil(out / 128), ceil(in / 128)], each block scaled by its max |w| / 448; norms, the
router, embeddings and the lm head keep their dtype, and `quantization_config` is Qwen's
({"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": [lm_head and
each layer's input_layernorm, mlp.gate, post_attention_layernorm], "quant_method": "fp8",
"weight_block_size": [128, 128]}).

awq (AutoAWQ's WQLinear_GEMM): the same projections become `qweight` int32 [in, out / 8],
`qzeros` int32 [in / group, out / 8] (eight 4-bit values per int32 in AutoAWQ's order) and
`scales` float16 [in / group, out], from AutoAWQ's zero-point round-to-nearest per group
(without its activation-aware search, which changes the values, not the layout); config
{"bits": 4, "group_size": G, "modules_to_not_convert": [each layer's mlp.gate],
"quant_method": "awq", "version": "gemm", "zero_point": true}.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runs from a checkout without an install
    sys.path.insert(0, str(REPO))

from pallas_kernels.quantized import quantize, quantize_int4_groups  # noqa: E402
from qwen_jax.config import ModelConfig  # noqa: E402
from qwen_jax.quantization import Quantization  # noqa: E402
from qwen_jax.quantized_io import FP8_SCALE, pack_awq  # noqa: E402
from qwen_jax.safetensors_io import CheckpointReader  # noqa: E402

# The linears quantised: attention projections, dense MLP and expert projections.
QUANTISED = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(experts\.\d+\.)?"
                       r"(gate|up|down)_proj)\.weight")


def fp8_tensors(weight: np.ndarray, block: tuple[int, int]) -> dict[str, np.ndarray]:
    """torch [out, in] -> {"weight": fp8 [out, in], "weight_scale_inv": f32 blocks}."""
    block_n, block_k = block
    q = quantize(np.asarray(weight, np.float32).T, "fp8", group_k=block_k, group_n=block_n)
    return {"weight": np.asarray(q.values).T.copy(),
            FP8_SCALE: np.asarray(q.scales, np.float32).T.copy()}


def awq_tensors(weight: np.ndarray, group: int) -> dict[str, np.ndarray]:
    """torch [out, in] -> AutoAWQ GEMM {"qweight", "qzeros", "scales"}."""
    out_features, in_features = weight.shape
    if in_features % group or out_features % 8:
        raise ValueError(f"a [{out_features}, {in_features}] linear cannot be AWQ-packed: "
                         f"in_features must be a multiple of group_size={group} and "
                         "out_features of 8 (AutoAWQ's WQLinear_GEMM)")
    q, scales, zeros = quantize_int4_groups(np.asarray(weight, np.float32).T, group)
    return {"qweight": pack_awq(np.asarray(q)), "qzeros": pack_awq(np.asarray(zeros)),
            "scales": np.asarray(scales, np.float16)}


def not_converted(cfg: ModelConfig, fmt: str) -> list[str]:
    """modules_to_not_convert as each tool writes it for a Qwen3-MoE model."""
    routers = [f"model.layers.{i}.mlp.gate" for i, kind in enumerate(cfg.layer_kinds)
               if kind == "moe"]
    if fmt == "awq":
        return routers
    names = ["lm_head"]
    for i, kind in enumerate(cfg.layer_kinds):
        names.append(f"model.layers.{i}.input_layernorm")
        if kind == "moe":
            names.append(f"model.layers.{i}.mlp.gate")
        names.append(f"model.layers.{i}.post_attention_layernorm")
    return names


def quantization_config(cfg: ModelConfig, fmt: str, block: tuple[int, int], group: int) -> dict:
    skip = not_converted(cfg, fmt)
    if fmt == "fp8":
        config = {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": skip,
                  "quant_method": "fp8", "weight_block_size": list(block)}
    else:
        config = {"bits": 4, "group_size": group, "modules_to_not_convert": skip,
                  "quant_method": "awq", "version": "gemm", "zero_point": True}
    Quantization.from_hf(config)  # what we write, we read
    return config


def quantise(model: Path, output: Path, fmt: str, *, block: tuple[int, int], group: int
             ) -> dict:
    """Writes output/model.safetensors and config.json (+ the other files of `model`);
    returns a summary."""
    reader = CheckpointReader(model)
    tensors, converted = {}, 0
    for name in sorted(reader.keys()):
        value = np.asarray(reader.get(name))
        if not QUANTISED.fullmatch(name):
            tensors[name] = value
            continue
        module = name[:-len(".weight")]
        parts = fp8_tensors(value, block) if fmt == "fp8" else awq_tensors(value, group)
        tensors.update({f"{module}.{key}": array for key, array in parts.items()})
        converted += 1
    output.mkdir(parents=True, exist_ok=True)
    for path in model.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != \
                "model.safetensors.index.json":
            shutil.copy(path, output / path.name)
    from safetensors.numpy import save_file
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = quantization_config(ModelConfig.from_hf(config), fmt,
                                                        block, group)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"format": fmt, "output": str(output), "linears_quantised": converted,
            "bytes": (output / "model.safetensors").stat().st_size}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="float HF checkpoint directory")
    parser.add_argument("--output", required=True)
    parser.add_argument("--format", required=True, choices=("fp8", "awq"))
    parser.add_argument("--block-size", type=int, default=128,
                        help="fp8: weight_block_size (square blocks), default 128 as Qwen's")
    parser.add_argument("--group-size", type=int, default=128,
                        help="awq: group_size (input rows per scale), default 128")
    args = parser.parse_args(argv)
    summary = quantise(Path(args.model), Path(args.output), args.format,
                       block=(args.block_size, args.block_size), group=args.group_size)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
