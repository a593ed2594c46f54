"""Quantised linears in HF checkpoints -> our stored layout (host numpy, read lazily).

FP8 (Qwen's checkpoints; vLLM's `Fp8LinearMethod` reads the same): `<module>.weight`
float8_e4m3fn [out, in] and `<module>.weight_scale_inv` [ceil(out / block_n),
ceil(in / block_k)], multiplied in (the name is DeepSeek's: the inverse of the scale that
quantised). Ours: values = weight.T, scales = weight_scale_inv.T as float32.

AWQ (AutoAWQ `WQLinear_GEMM`): `<module>.qweight` int32 [in, out / 8], `qzeros` int32
[in / group, out / 8], `scales` float16 [in / group, out]. Eight 4-bit values per int32:
nibble i (bits 4i..4i+3) of packed column c holds column 8c + AWQ_ORDER[i]. Ours: the
nibbles repacked two rows per byte (pallas_kernels/quantized.pack_int4), zeros one per
byte, scales as they are.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.quantized import QuantizedWeight, dequantize, pack_int4

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: column of each nibble
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # nibble of each column (vLLM's name)
FP8_SCALE = "weight_scale_inv"
AWQ_TENSORS = ("qweight", "qzeros", "scales")


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """int32 [..., R, C/8] in AutoAWQ's order -> uint8 nibbles [..., R, C]."""
    shifts = 4 * np.asarray(AWQ_REVERSE_ORDER, np.uint32)                # [8]
    words = np.asarray(packed).view(np.uint32)[..., None]                 # [..., C/8, 1]
    nibbles = (words >> shifts) & 0xF                                     # [..., C/8, 8]
    return nibbles.reshape(*packed.shape[:-1], packed.shape[-1] * 8).astype(np.uint8)


def pack_awq(q: np.ndarray) -> np.ndarray:
    """uint8 nibbles [..., R, C] -> int32 [..., R, C/8] in AutoAWQ's order."""
    groups = np.asarray(q, np.uint32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    shifted = groups[..., list(AWQ_ORDER)] << (4 * np.arange(8, dtype=np.uint32))
    return np.bitwise_or.reduce(shifted, axis=-1).view(np.int32)


STORED_KEYS = {"fp8": ("values", "scales"), "int4": ("values", "scales", "zeros")}


def stored_array(reader, module: str, kind: str, key: str, shape: tuple[int, int],
                 group: tuple[int | None, int]) -> np.ndarray:
    """One of our stored arrays ("values", "scales", "zeros") of an HF linear; `shape` its
    [in, out]; group: (group_k, group_n), the format's scale group."""
    k, n = shape
    group_k, group_n = group
    if kind == "fp8":
        if key == "values":
            return reader.get(f"{module}.weight", (n, k)).T
        scale_shape = (-(-n // group_n), -(-k // (group_k or k)))
        return reader.get(f"{module}.{FP8_SCALE}", scale_shape).T.astype(np.float32)
    if kind == "int4":
        if group_k is None:
            raise ValueError(f"{module}: int4 weights need a group size (group_k)")
        groups = k // group_k
        if key == "values":
            return pack_int4(unpack_awq(reader.get(f"{module}.qweight", (k, n // 8))),
                             group_k)
        if key == "zeros":
            return unpack_awq(reader.get(f"{module}.qzeros", (groups, n // 8)))
        return reader.get(f"{module}.scales", (groups, n))
    raise ValueError(f"{module}: safetensors checkpoints hold fp8 or AWQ weights, not "
                     f"{kind!r} (int8 is made at load with --quantization int8)")


def stored_quantized(reader, module: str, kind: str, shape: tuple[int, int], *,
                     group: tuple[int | None, int]) -> dict[str, np.ndarray]:
    """All our stored arrays of one HF linear (see `stored_array`)."""
    return {key: stored_array(reader, module, kind, key, shape, group)
            for key in STORED_KEYS[kind]}


def stored_kind(reader, module: str) -> str | None:
    """How the checkpoint stores an HF linear: "fp8", "int4" (AWQ) or None (float)."""
    if f"{module}.{FP8_SCALE}" in reader:
        return "fp8"
    return "int4" if f"{module}.qweight" in reader else None


def float_linear(reader, module: str, shape: tuple[int, int], quantization=None):
    """The [in, out] float weight of an HF linear the model keeps unquantised: the
    checkpoint's `weight` transposed (a lazy view), or, where the checkpoint stores this
    module quantised (a router, modules_to_not_convert differing between the layers of
    one scanned segment), its fp8 / AWQ tensors dequantised."""
    k, n = shape
    kind = stored_kind(reader, module)
    if kind is None:
        return reader.get(f"{module}.weight", (n, k)).T
    if quantization is None:
        raise ValueError(f"checkpoint stores {module} quantised ({kind}) but its config.json "
                         "has no quantization_config")
    fmt = quantization.weight_format
    stored = stored_quantized(reader, module, kind, shape, group=(fmt.group_k, fmt.group_n))
    weight = QuantizedWeight(values=stored["values"], scales=stored["scales"],
                             zeros=stored.get("zeros"), kind=kind, group_k=fmt.group_k,
                             group_n=fmt.group_n)
    return np.asarray(dequantize(weight, jnp.float32))
