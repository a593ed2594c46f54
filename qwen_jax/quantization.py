"""Weight quantisation: the method (a checkpoint's `quantization_config`, or `--quantization`
for quantising at load), its weight format, and which modules it applies to.

Pure Python (no jax): configs and the CLI use it without loading jax.

- fp8: Qwen's FP8 checkpoints (`Qwen3-30B-A3B-FP8`, `Qwen3-235B-A22B-FP8`): `quant_method
  "fp8"`, `fmt "e4m3"`, `weight_block_size [block_n, block_k]` (128 x 128); each quantised
  linear stores `weight` (float8_e4m3fn, [out, in]) and `weight_scale_inv` (float32, one
  per block, [ceil(out / block_n), ceil(in / block_k)]), w = weight * weight_scale_inv.
  `--quantization fp8` on a float checkpoint makes the same layout at load.
- int8: `--quantization int8`, weight-only int8 with one scale per output channel, made
  at load from a float checkpoint.
- awq: AutoAWQ checkpoints (`quant_method "awq"`, `bits 4`, `version "gemm"`,
  `zero_point true`, `group_size`): `qweight` / `qzeros` int32 ([in, out / 8] and
  [in / group, out / 8], 8 nibbles per int32 in AutoAWQ's order) and float16 `scales`
  [in / group, out]; w = (q - zero) * scale. Stored on the device as int4 (two per byte).

Activations stay in the model dtype (weight-only: vLLM's block-fp8 path also quantises
activations per token group; we do not). Norms, the router (`mlp.gate`), embeddings and
the lm head are never quantised; a checkpoint that stores one of them quantised has it
dequantised at load.
"""

from __future__ import annotations

import dataclasses
import typing

from qwen_jax.options import QUANTIZATION_METHODS
from qwen_jax.validation import require

ONLINE_METHODS = ("fp8", "int8")
CHECKPOINT_METHODS = ("fp8", "awq")
# Methods people ship Qwen3 checkpoints in that we do not read, with what they are.
_UNSUPPORTED = {"gptq": "GPTQ", "gptq_marlin": "GPTQ", "bitsandbytes": "bitsandbytes",
                "compressed-tensors": "llm-compressor's compressed-tensors",
                "compressed_tensors": "llm-compressor's compressed-tensors",
                "awq_marlin": "AWQ in Marlin layout", "gguf": "GGUF", "modelopt": "ModelOpt",
                "fbgemm_fp8": "FBGEMM fp8", "mxfp4": "MXFP4", "hqq": "HQQ", "eetq": "EETQ"}
FP8_BLOCK = (128, 128)  # [block_n, block_k], Qwen's weight_block_size
AWQ_GROUP = 128         # AutoAWQ's default q_group_size (presets planned as AWQ use it)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightFormat:
    """How one stored weight is quantised (pallas_kernels/quantized.py has the layouts)."""

    kind: str                    # "fp8" | "int8" | "int4"
    group_k: int | None = None   # input rows per scale; None: all of them (per channel)
    group_n: int = 1             # output columns per scale


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantization:
    """A model's weight quantisation. `online`: quantised at load from float weights."""

    method: str
    # Quantised at load from float weights: how the loader gets them, not what they are.
    online: bool = dataclasses.field(default=False, compare=False)
    weight_block_size: tuple[int, int] = FP8_BLOCK   # fp8: (block_n, block_k)
    group_size: int = AWQ_GROUP                       # awq
    modules_to_not_convert: tuple[str, ...] = ()

    def __post_init__(self):
        require(self.method in QUANTIZATION_METHODS, "quant_method", self.method,
                f"one of {', '.join(QUANTIZATION_METHODS)}")
        block_n, block_k = self.weight_block_size
        require(block_n >= 1 and block_k >= 16 and block_k % 16 == 0, "weight_block_size",
                list(self.weight_block_size),
                "[block_n, block_k] with block_n >= 1 and block_k a multiple of 16")
        require(self.group_size >= 32 and self.group_size % 32 == 0, "group_size",
                self.group_size, "a multiple of 32 (32, 64, 128, ...)")
        require(not self.online or self.method in ONLINE_METHODS, "quantization", self.method,
                f"an AWQ checkpoint; quantising at load supports {', '.join(ONLINE_METHODS)}")

    @property
    def weight_format(self) -> WeightFormat:
        if self.method == "fp8":
            block_n, block_k = self.weight_block_size
            return WeightFormat(kind="fp8", group_k=block_k, group_n=block_n)
        if self.method == "int8":
            return WeightFormat(kind="int8")
        return WeightFormat(kind="int4", group_k=self.group_size)

    @property
    def bytes_per_weight(self) -> float:
        """Stored bytes per quantised weight element, its share of scales and zero points
        included: fp8 1 + 4 / block area, int8 1 (one fp32 scale per output channel is
        negligible), AWQ int4 1/2 + (2 + 1) / group_size (fp16 scale, uint8 zero point)."""
        if self.method == "fp8":
            block_n, block_k = self.weight_block_size
            return 1.0 + 4.0 / (block_n * block_k)
        if self.method == "int8":
            return 1.0
        return 0.5 + 3.0 / self.group_size

    def converts(self, module: str) -> bool:
        """Whether `module` (an HF module name) is quantised: not listed, as a run of its
        dot-separated parts, in modules_to_not_convert ("mlp.gate" matches
        model.layers.3.mlp.gate, not mlp.gate_proj)."""
        parts = module.split(".")
        for entry in self.modules_to_not_convert:
            skip = entry.split(".")
            if any(parts[i:i + len(skip)] == skip for i in range(len(parts) - len(skip) + 1)):
                return False
        return True

    def format_for(self, modules: list[str]) -> WeightFormat | None:
        """The format of a stacked weight holding `modules` (one per layer): quantised only
        if every one of them is (a mix is kept in the model dtype, the quantised layers
        dequantised at load)."""
        return self.weight_format if all(self.converts(m) for m in modules) else None

    def to_hf_dict(self) -> dict:
        """The `quantization_config` this quantisation reads back from (as stored)."""
        skip = list(self.modules_to_not_convert)
        if self.method == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.weight_block_size),
                    "modules_to_not_convert": skip}
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm", "modules_to_not_convert": skip or None}
        return {"quant_method": "int8", "modules_to_not_convert": skip}

    @classmethod
    def from_hf(cls, config: dict) -> "Quantization":
        """Parse an HF `quantization_config`; ValueError naming the field otherwise."""
        method = str(config.get("quant_method", "")).lower()
        skip = tuple(config.get("modules_to_not_convert") or config.get("ignored_layers")
                     or ())
        if method == "fp8":
            return cls(method="fp8", weight_block_size=_fp8_block(config),
                       modules_to_not_convert=skip)
        if method == "awq":
            return cls(method="awq", group_size=_awq_group(config), modules_to_not_convert=skip)
        if method == "int8":  # written by `qwen-jax convert` of an int8 model (orbax)
            return cls(method="int8", modules_to_not_convert=skip)
        what = f" ({_UNSUPPORTED[method]})" if method in _UNSUPPORTED else ""
        raise ValueError(f"quantization_config.quant_method is {config.get('quant_method')!r}"
                         f"{what}, which qwen-jax does not read; supported: fp8 (block-wise, "
                         "as Qwen ships its FP8 checkpoints) and awq (AutoAWQ 4-bit GEMM); "
                         "--quantization fp8|int8 quantises a float checkpoint at load")


def _fp8_block(config: dict) -> tuple[int, int]:
    fmt = config.get("fmt", "e4m3")
    require(fmt == "e4m3", "quantization_config.fmt", fmt, "'e4m3' (float8_e4m3fn)")
    block = config.get("weight_block_size")
    require(block is not None, "quantization_config.weight_block_size", block,
            "[block_n, block_k]: per-tensor fp8 checkpoints are not supported, only "
            "block-wise ones (Qwen's weight_block_size [128, 128])")
    ok = isinstance(block, (list, tuple)) and len(block) == 2 and all(
        isinstance(b, int) for b in block)
    require(ok, "quantization_config.weight_block_size", block,
            "two integers [block_n, block_k]")
    block_n, block_k = typing.cast(tuple[int, int], tuple(block or ()))
    return block_n, block_k


def _awq_group(config: dict) -> int:
    bits = config.get("bits", config.get("w_bit", 4))
    require(bits == 4, "quantization_config.bits", bits, "4 (AWQ int4)")
    version = str(config.get("version", "gemm")).lower()
    require(version == "gemm", "quantization_config.version", version,
            "'gemm' (AutoAWQ's GEMM packing)")
    zero_point = config.get("zero_point", True)
    require(zero_point is True, "quantization_config.zero_point", zero_point, "true")
    group = config.get("group_size", config.get("q_group_size", AWQ_GROUP))
    require(isinstance(group, int) and group > 0, "quantization_config.group_size", group,
            "a positive multiple of 32 (-1, one group per column, is not supported)")
    return int(group)


def resolve(checkpoint: Quantization | None, requested: str | None, *,
            dummy: bool = False) -> Quantization | None:
    """The quantisation a model is built with: the checkpoint's, or `requested`
    (`--quantization`) made at load; a request must match a quantised checkpoint's method.
    With dummy weights (presets, load_format dummy) every method can be asked for."""
    if requested is None or requested == "auto":
        return checkpoint
    require(requested in QUANTIZATION_METHODS, "quantization", requested,
            f"one of {', '.join(QUANTIZATION_METHODS)}")
    if checkpoint is not None:
        require(checkpoint.method == requested, "quantization", requested,
                f"{checkpoint.method!r}, the checkpoint's quantization_config.quant_method")
        return checkpoint
    if dummy:
        return Quantization(method=requested)
    return Quantization(method=requested, online=True)
