"""Model FLOPs and bytes of one engine step, from what the engine scheduled, and the peak
FLOP/s and bytes/s of the device it ran on. Pure Python (no jax).

FLOPs are the model's matmul work, 2 per multiply-add, for the real tokens only (padding
is the bucket's waste, not model work): q/k/v/o projections, attention scores and values
over each token's causal context, the dense MLPs, the router and the k experts each token
is routed to, and the lm head on each scheduled sequence's last row. Elementwise work
(norms, RoPE, softmax, SiLU) is left out, as in PaLM's MFU.

Bytes are what the step must read and write in device memory at the least: every weight it
touches once (the routed experts only; the embedding rows of the step's tokens; quantised
projections and experts at their stored bytes, scales included), each
sequence's KV context read once per layer, and the new tokens' K/V written. Activations
are not counted. Under tensor parallelism the few replicated weights (norms, router) count
once, so the figure is a floor per replica.

Which experts a step touches is decided on the device and not reported back, so their
bytes use the expectation under uniform routing: a token picks k distinct experts of E,
missing a given one with probability 1 - k/E, so T tokens touch E(1 - (1 - k/E)^T)
experts on average. It is exact for one token (k) and for many (E); a skewed router
touches fewer, so in between the bytes (and the bandwidth utilisation) are an upper
estimate. FLOPs do not depend on it: each token runs exactly k experts.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Sequence

from qwen_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepShape:
    """The real work of one step: per scheduled sequence, its new tokens and the tokens in
    its cache once the step has written them (the context its last token attends to)."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.query_lens) != len(self.context_lens):
            raise ValueError(f"query_lens has {len(self.query_lens)} entries, context_lens "
                             f"{len(self.context_lens)}: one each per sequence")
        if self.query_lens and (min(self.query_lens) < 1  # C loops: one per engine step
                                or not all(map(operator.le, self.query_lens, self.context_lens))):
            q, c = next((q, c) for q, c in zip(self.query_lens, self.context_lens)
                        if not 1 <= q <= c)
            raise ValueError(f"a sequence has query_len={q} and context_len={c}: "
                             "need 1 <= query_len <= context_len")

    @functools.cached_property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @functools.cached_property
    def attended_pairs(self) -> int:
        """(query, key) pairs under the causal mask: a chunk of q new tokens ending at
        context c has its i-th token (0-based) see c - q + i + 1 keys."""
        pairs = sum(map(operator.mul, self.query_lens, self.context_lens))  # per step: C loops
        if self.query_lens and max(self.query_lens) > 1:  # decodes (q = 1) hide no pairs
            pairs -= sum(q * (q - 1) // 2 for q in self.query_lens)
        return pairs


@dataclasses.dataclass(frozen=True)
class StepCost:
    flops: int
    weight_bytes: float  # fractional: the expected routed experts
    kv_read_bytes: int
    kv_write_bytes: int

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes


def expected_experts_touched(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Distinct experts that `num_tokens` tokens routed uniformly at random touch."""
    if num_experts == 0 or num_tokens == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """FLOPs and bytes of a step of one model, weights in `param_bytes`-byte elements and
    the KV cache in `kv_bytes`-byte elements. A quantised model (`config.quantization`)
    stores its projections and experts at the quantisation's bytes per weight; norms,
    router, embeddings and lm head stay in `param_bytes` (its modules_to_not_convert are
    not looked at: they are the router and norms in Qwen's checkpoints)."""

    config: ModelConfig
    param_bytes: int
    kv_bytes: int

    @classmethod
    def for_engine(cls, engine) -> "CostModel":
        """The cost model of an LLMEngine: its weights' and KV cache's dtypes."""
        import numpy as np
        return cls(engine.model_config, np.dtype(engine.model.dtype).itemsize,
                   np.dtype(engine.kv_cache_dtype).itemsize)

    @functools.cached_property
    def _num_moe_layers(self) -> int:
        return sum(kind == "moe" for kind in self.config.layer_kinds)

    def _attention_weights(self) -> int:
        """Elements of one layer's attention weights: projections, biases, norms."""
        c = self.config
        d = c.hidden_size
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        projections = d * (q + 2 * kv) + q * d
        biases = (q + 2 * kv + d) if c.attention_bias else 0
        return projections + biases + 2 * c.head_dim + 2 * d  # q/k norms, two layer norms

    def flops(self, shape: StepShape) -> int:
        c = self.config
        t, d = shape.num_tokens, c.hidden_size
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        attention = 2 * t * d * (q + 2 * kv) + 2 * t * q * d + 4 * q * shape.attended_pairs
        num_moe = self._num_moe_layers
        num_dense = c.num_hidden_layers - num_moe
        dense_mlp = 2 * t * 3 * d * c.intermediate_size
        moe_mlp = (2 * t * d * c.num_experts
                   + 2 * t * c.num_experts_per_tok * 3 * d * c.moe_intermediate_size)
        lm_head = 2 * shape.num_seqs * d * c.vocab_size
        return (c.num_hidden_layers * attention + num_dense * dense_mlp + num_moe * moe_mlp
                + lm_head)

    def weight_elements(self, shape: StepShape,
                        experts_touched: Sequence[float] | None = None) -> float:
        """Weight elements the step reads; `experts_touched` (one count per MoE layer)
        replaces the uniform-routing expectation where the counts are known."""
        linear, other = self._weight_elements(shape, experts_touched)
        return linear + other

    def _weight_elements(self, shape: StepShape, experts_touched: Sequence[float] | None
                         ) -> tuple[float, float]:
        """(elements of the projections and experts a quantisation stores quantised, the
        rest: norms, router, embedding rows, lm head)."""
        c = self.config
        d, t = c.hidden_size, shape.num_tokens
        num_moe = self._num_moe_layers
        if experts_touched is None:
            expected = expected_experts_touched(t, c.num_experts, c.num_experts_per_tok)
            experts_touched = [expected] * num_moe
        elif len(experts_touched) != num_moe:
            raise ValueError(f"experts_touched has {len(experts_touched)} counts; the model "
                             f"has {num_moe} MoE layers")
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        projections = d * (q + 2 * kv) + q * d
        linear = (c.num_hidden_layers * projections
                  + (c.num_hidden_layers - num_moe) * 3 * d * c.intermediate_size
                  + 3 * d * c.moe_intermediate_size * sum(experts_touched))
        attention_rest = self._attention_weights() - projections
        embedding_rows = t * d  # the rows of this step's tokens; the lm head reads it all
        other = (c.num_hidden_layers * attention_rest + num_moe * d * c.num_experts
                 + embedding_rows + d + d * c.vocab_size)  # + final norm, lm head
        return linear, other

    def weight_bytes(self, shape: StepShape,
                     experts_touched: Sequence[float] | None = None) -> float:
        linear, other = self._weight_elements(shape, experts_touched)
        quantization = self.config.quantization
        linear_bytes = (self.param_bytes if quantization is None
                        else quantization.bytes_per_weight)
        return linear * linear_bytes + other * self.param_bytes

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        c = self.config
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * self.kv_bytes

    def cost(self, shape: StepShape, experts_touched: Sequence[float] | None = None
             ) -> StepCost:
        per_token = self.kv_bytes_per_token()
        return StepCost(flops=self.flops(shape),
                        weight_bytes=self.weight_bytes(shape, experts_touched),
                        kv_read_bytes=sum(shape.context_lens) * per_token,
                        kv_write_bytes=shape.num_tokens * per_token)


# ---- device peaks ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """Datasheet peaks of one device: dense tensor-core FLOP/s (no sparsity) in bf16 and in
    TF32 (what XLA runs float32 matmuls in on NVIDIA GPUs by default), and HBM bytes/s."""

    name: str
    bf16_flops: float
    tf32_flops: float
    memory_bytes_per_s: float

    def flops(self, param_bytes: int) -> float:
        return self.bf16_flops if param_bytes <= 2 else self.tf32_flops


# Matched in order, as case-insensitive substrings of jax's `device_kind` (e.g. "NVIDIA
# H100 80GB HBM3"), most specific first: "GH200" contains "H200", "L40S" contains "L4".
PEAKS: tuple[tuple[str, DevicePeak], ...] = (
    ("GH200", DevicePeak("GH200 (96 GB HBM3)", 989e12, 494e12, 4.0e12)),
    ("H200", DevicePeak("H200", 989e12, 494e12, 4.8e12)),
    ("H100 NVL", DevicePeak("H100 NVL", 835e12, 418e12, 3.9e12)),
    ("H100 PCIe", DevicePeak("H100 PCIe", 756e12, 378e12, 2.0e12)),
    ("H100", DevicePeak("H100 SXM", 989e12, 494e12, 3.35e12)),
    ("A100-SXM4-40GB", DevicePeak("A100 SXM 40 GB", 312e12, 156e12, 1.555e12)),
    ("A100-PCIE-40GB", DevicePeak("A100 PCIe 40 GB", 312e12, 156e12, 1.555e12)),
    ("A100 80GB PCIe", DevicePeak("A100 PCIe 80 GB", 312e12, 156e12, 1.935e12)),
    ("A100", DevicePeak("A100 SXM 80 GB", 312e12, 156e12, 2.039e12)),
    ("B200", DevicePeak("B200", 2.25e15, 1.1e15, 8.0e12)),
    ("L40S", DevicePeak("L40S", 362e12, 183e12, 0.864e12)),
    ("L4", DevicePeak("L4", 121e12, 60e12, 0.3e12)),
)


def device_peak(device_kind: str) -> DevicePeak | None:
    """The peaks of a device by jax's `device_kind`; None where unknown (CPUs among them:
    report absolute FLOP/s and bytes/s there)."""
    kind = device_kind.lower()
    for key, peak in PEAKS:
        if key.lower() in kind:
            return peak
    return None
