"""Speculative decoding's host side: the config users pass (vLLM's `speculative_config`
fields) and the n-gram proposer, which drafts a request's next tokens from its own
earlier tokens (prompt lookup). Pure Python.

The n-gram proposer, as vLLM's: take the request's last n tokens for n from
`prompt_lookup_max` down to `prompt_lookup_min`; at the first n whose n-gram occurred
earlier, draft the up to k tokens that followed its latest earlier occurrence.
"""

from __future__ import annotations

import array
import dataclasses
import json
from collections.abc import Mapping, Sequence

from qwen_jax.validation import require

METHODS = ("ngram", "draft_model", "eagle3")
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "model", "adaptive_draft_length")
MAX_SPECULATIVE_TOKENS = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: draft tokens checked per step
    prompt_lookup_min: int = 1   # ngram: shortest suffix n-gram looked up
    prompt_lookup_max: int | None = None  # ngram: longest (None: prompt_lookup_min)
    # draft_model / eagle3: the draft's directory (None: the embedded model's shipped draft)
    model: str | None = None
    # ours, not vLLM's: up to num_speculative_tokens drafts a sequence, chosen per step by
    # acceptance and step cost (serving/core/draft_length.py); False: always all proposed
    adaptive_draft_length: bool = True

    def __post_init__(self) -> None:
        field = "speculative_config"
        require(self.method in METHODS, f"{field}.method", self.method,
                f"one of {', '.join(METHODS)}")
        require(isinstance(self.num_speculative_tokens, int)
                and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
                f"{field}.num_speculative_tokens", self.num_speculative_tokens,
                f"an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        require(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                f"{field}.prompt_lookup_min", self.prompt_lookup_min, "an int >= 1")
        if self.prompt_lookup_max is None:
            object.__setattr__(self, "prompt_lookup_max", self.prompt_lookup_min)
        require(isinstance(self.prompt_lookup_max, int)
                and self.prompt_lookup_max >= self.prompt_lookup_min,
                f"{field}.prompt_lookup_max", self.prompt_lookup_max,
                f"an int >= prompt_lookup_min={self.prompt_lookup_min}")
        require(isinstance(self.adaptive_draft_length, bool),
                f"{field}.adaptive_draft_length", self.adaptive_draft_length, "true or false")
        require(self.model is None or isinstance(self.model, str) and bool(self.model),
                f"{field}.model", self.model, "a model directory or name")

    @classmethod
    def parse(cls, value: str | Mapping | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From `--speculative-config`'s JSON text, a dict (`LLM(speculative_config=)`),
        a config, or None (no speculation). Unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r} "
                                 f"({e.msg})") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        unknown = sorted(set(value) - set(_FIELDS))
        require(not unknown, "speculative_config's keys", unknown,
                f"among {', '.join(_FIELDS)}")
        require("method" in value, "speculative_config.method", None,
                f"one of {', '.join(METHODS)}")
        require("num_speculative_tokens" in value, "speculative_config.num_speculative_tokens",
                None, f"an int in [1, {MAX_SPECULATIVE_TOKENS}]")
        return cls(**dict(value))


def propose_ngram(token_ids: Sequence[int], *, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for a request whose tokens so far are `token_ids`: what
    followed the latest earlier occurrence of its longest suffix n-gram (max_n down to
    min_n); [] when none occurred. The search is `bytes.rfind` over the ids as int32
    bytes (C speed, no per-token Python), keeping only hits on a token boundary."""
    tokens = list(token_ids)
    num = len(tokens)
    ids = array.array("i", tokens)
    data, width = ids.tobytes(), ids.itemsize  # width: bytes per id
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        needle = data[(num - n) * width:]
        end = (num - 1) * width  # a match must start before the suffix itself
        while (hit := data.rfind(needle, 0, end)) >= 0:
            if hit % width == 0:
                start = hit // width + n
                return tokens[start:start + k]
            end = hit + len(needle) - 1  # look further left
    return []


def fit_draft_rows(scheduled: Sequence, max_rows: int) -> int:
    """Drops draft tokens (from the last scheduled sequence back) until the step's rows,
    a sequence's and one per draft, fit `max_rows` (the largest sequence bucket: with
    speculation, by default max_num_seqs * (1 + k), serving/engine/config.py). Returns
    the tokens dropped. `scheduled`: the step's ScheduledSeqs, changed in place."""
    excess = len(scheduled) + sum(seq.num_drafts for seq in scheduled) - max_rows
    dropped = 0
    for seq in reversed(scheduled):
        if excess <= 0:
            break
        cut = min(seq.num_drafts, excess)
        seq.num_drafts -= cut
        seq.num_new_tokens -= cut
        excess -= cut
        dropped += cut
    return dropped


__all__ = ["METHODS", "MAX_SPECULATIVE_TOKENS", "SpeculativeConfig", "fit_draft_rows",
           "propose_ngram"]
