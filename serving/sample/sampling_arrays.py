"""What a step's sampler reads and returns: `SamplingArrays` (per-sequence parameters of
one padded step, built on the host from each sequence's `SamplingEntry`), `SamplerOutput`
and `TokenLogprobs`."""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Sequence

import jax
import numpy as np

from serving.core.request import SamplingParams
from serving.structured_output.token_mask import TokenMask, inactive_mask

jax.tree_util.register_dataclass(TokenMask, data_fields=["active", "bits"], meta_fields=[])

NUM_TOP_LOGPROBS = 20  # vLLM's maximum; always computed, sliced on the host
NUM_BLOCKED = 32  # stop/eos ids suppressed until min_tokens; padded with -1
# In penalty_tokens: the token of the step in flight (overlapped loop), unknown on the
# host when the next step's arrays are built; the device puts each row's in (its input).
PENDING_TOKEN = -2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingArrays:
    """Per-sequence sampling parameters for one padded step (numpy on host)."""

    temperature: np.ndarray  # f32[S]; < SAMPLING_EPS means greedy
    top_p: np.ndarray  # f32[S]
    top_k: np.ndarray  # i32[S]; 0 = disabled
    min_p: np.ndarray  # f32[S]
    presence_penalty: np.ndarray  # f32[S]
    frequency_penalty: np.ndarray  # f32[S]
    repetition_penalty: np.ndarray  # f32[S]
    seed: np.ndarray  # u32[S]
    output_index: np.ndarray  # i32[S]: which output token this draw is
    blocked_ids: np.ndarray  # i32[S, NUM_BLOCKED]: ids masked this step (min_tokens)
    penalty_tokens: np.ndarray  # i32[S, W]: prompt + output ids, -1 padded (W = max_model_len)
    #   and PENDING_TOKEN for the token in flight
    num_prompt_tokens: np.ndarray  # i32[S]: how many of penalty_tokens are prompt
    want_logprobs: np.ndarray  # bool[]: some row asked for logprobs (else none are computed)
    # Allowed tokens of rows under a grammar (serving/structured_output/token_mask.py). None
    # only in transit: the runner swaps in a device-resident inactive mask for steps without
    # a grammar.
    token_mask: TokenMask | None
    # i32[S]: each row's input token this step (on the device only, set by the runner):
    # what PENDING_TOKEN stands for in its penalty_tokens. None: no token in flight.
    pending_tokens: np.ndarray | jax.Array | None = None


@dataclasses.dataclass(slots=True)
class SamplingEntry:
    """One sequence's row of a step's SamplingArrays (built per sequence per step: slots,
    positional construction, no validation)."""

    params: SamplingParams
    seed: int
    output_index: int  # which output token this draw is
    blocked_ids: tuple[int, ...]  # ids masked this step (eos/stop ids before min_tokens)
    penalty_tokens: list[int] | None  # prompt + output ids; None unless penalties apply
    num_prompt_tokens: int
    row: bytes | None = None  # sampling_row(params, seed), where the caller keeps it


def sampling_row(params: SamplingParams, seed: int) -> bytes:
    """A sequence's fixed sampling values in `_ROW_COLUMNS` order, packed as float64 (exact
    for u32 seeds): a sequence's row is the same every step, so the engine packs it once
    and a step's table is one join of its rows' bytes."""
    return struct.pack(_ROW_FORMAT, params.temperature, params.top_p, max(params.top_k, 0),
                       params.min_p, params.presence_penalty, params.frequency_penalty,
                       params.repetition_penalty, seed, params.logprobs is not None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Per row: the logprob of one chosen token, its rank, and the most likely tokens."""

    logprob: jax.Array  # f32[R]
    rank: jax.Array  # i32[R]: 1 + the number of strictly more likely tokens
    top_ids: jax.Array  # i32[R, NUM_TOP_LOGPROBS] most likely first
    top_logprobs: jax.Array  # f32[R, NUM_TOP_LOGPROBS]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerOutput:
    """What one step samples: a token per sequence and logprobs of the raw distribution."""

    token_ids: jax.Array | np.ndarray  # i32[S]
    logprobs: TokenLogprobs | None  # zeros on the device, None on the host, when not asked
    # prompt_logprobs: the scored prompt rows' (the step's score_rows, in order); None in
    # steps without them
    prompt_logprobs: TokenLogprobs | None = None


# SamplingArrays fields of sampling_row's values: (name, dtype, padding rows' value)
_ROW_COLUMNS = (("temperature", np.float32, 0), ("top_p", np.float32, 1),
                ("top_k", np.int32, 0), ("min_p", np.float32, 0),
                ("presence_penalty", np.float32, 0), ("frequency_penalty", np.float32, 0),
                ("repetition_penalty", np.float32, 1), ("seed", np.uint32, 0))
_PADDING_ROW = tuple(pad for _, _, pad in _ROW_COLUMNS) + (False,)
_ROW_FORMAT = f"={len(_PADDING_ROW)}d"  # sampling_row's values: the columns, want_logprobs


@functools.lru_cache(maxsize=64)
def _no_penalty_tokens(num_seqs: int, width: int) -> np.ndarray:
    """The all-padding [S, W] penalty array, built once per shape and shared read-only:
    most steps use no penalties and should not allocate and fill it again."""
    template = np.full((num_seqs, width), -1, np.int32)
    template.flags.writeable = False
    return template


@functools.lru_cache(maxsize=64)
def _no_token_mask(num_seqs: int, vocab_size: int) -> TokenMask:
    """The inactive mask, built once per shape and shared read-only (as _no_penalty_tokens)."""
    mask = inactive_mask(num_seqs, vocab_size)
    mask.bits.flags.writeable = False
    return mask


def build_sampling_arrays(entries: Sequence[SamplingEntry], num_padded_seqs: int,
                          max_model_len: int, vocab_size: int,
                          token_mask: TokenMask | None = None) -> SamplingArrays:
    """One row per real sequence's entry; rows past them are greedy padding. `token_mask`:
    the grammar rows' allowed tokens this step (None: no row is constrained)."""
    s, n = num_padded_seqs, len(entries)
    # Every fixed value of every row through one float64 table (exact for u32 seeds).
    table = np.empty((s, len(_PADDING_ROW)), np.float64)
    table[n:] = _PADDING_ROW
    if n:
        rows = b"".join([e.row if e.row is not None else sampling_row(e.params, e.seed)
                         for e in entries])
        table[:n] = np.frombuffer(rows, np.float64).reshape(n, -1)
    columns = {name: table[:, j].astype(dtype) for j, (name, dtype, _) in enumerate(_ROW_COLUMNS)}
    output_index = np.zeros(s, np.int32)
    output_index[:n] = np.fromiter((e.output_index for e in entries), np.int32, n)
    arrays = SamplingArrays(
        **columns, output_index=output_index,
        blocked_ids=np.full((s, NUM_BLOCKED), -1, np.int32),
        penalty_tokens=_no_penalty_tokens(s, max_model_len),
        num_prompt_tokens=np.zeros(s, np.int32),
        want_logprobs=np.array(bool(table[:n, -1].any())),
        token_mask=_no_token_mask(s, vocab_size) if token_mask is None else token_mask)
    for i in [i for i, e in enumerate(entries) if e.blocked_ids or e.penalty_tokens is not None]:
        entry = entries[i]  # rows with min_tokens or penalties only
        if entry.blocked_ids:
            arrays.blocked_ids[i, :len(entry.blocked_ids)] = entry.blocked_ids
        tokens = entry.penalty_tokens
        if tokens is not None:  # only requests that use penalties pay for this copy
            if not arrays.penalty_tokens.flags.writeable:
                arrays.penalty_tokens = arrays.penalty_tokens.copy()
            arrays.penalty_tokens[i, :len(tokens)] = tokens
            arrays.num_prompt_tokens[i] = entry.num_prompt_tokens
    return arrays


def uses_penalty_rows(sa: SamplingArrays) -> bool:
    """Whether some row of a step applies penalties (so its penalty tokens must travel)."""
    return bool(np.any(sa.presence_penalty != 0) or np.any(sa.frequency_penalty != 0)
                or np.any(sa.repetition_penalty != 1))
