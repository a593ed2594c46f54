"""SchedulerOutput -> padded ragged ModelInputs for one (T, S) bucket. Numpy only.

Padding tokens write to slot 0 of the scratch page 0 and belong to no sequence;
padding sequences have zero length (query_start repeats its last real value,
kv_lens 0), so attention and the MoE router can mask them by position alone.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import numpy as np

from serving.core.buckets import pick_bucket, pick_seq_bucket
from serving.core.request import Request
from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput


@dataclasses.dataclass
class ModelInputs:
    """One padded step's inputs: host numpy arrays until the step (or the multi-host
    broadcast) moves them to the devices. The model runner registers the type as a pytree,
    so the jitted step takes it as it is."""

    token_ids: np.ndarray  # int32[T]
    positions: np.ndarray  # int32[T]
    slot_mapping: np.ndarray  # int32[T]: page_id * page_size + offset; padding -> 0
    query_start: np.ndarray  # int32[S+1]: cumulative chunk lengths
    kv_lens: np.ndarray  # int32[S]: tokens in the cache after this step; 0 for padding
    page_table: np.ndarray  # int32[S, pages_per_seq]; 0 for unused entries
    logits_index: np.ndarray  # int32[S]: flat index of each sequence's last token
    num_seqs: np.ndarray  # int32[] real sequences
    # int32[T]: for a token the previous step sampled and the host has not read yet, that
    # step's row (the device fills it in); -1 elsewhere
    prev_index: np.ndarray
    # int32[T]: each token's LoRA adapter slot (serving/core/lora_slots.py); 0: none
    lora_slots: np.ndarray

    @property
    def num_tokens(self) -> int:
        """Real tokens (host arrays only): where the last sequence's chunk ends."""
        return int(self.query_start[-1])

    @property
    def padded_num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def padded_num_seqs(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def bucket(self) -> tuple[int, int]:
        """(T, S): the compiled step this batch runs."""
        return self.padded_num_tokens, self.padded_num_seqs


def step_bucket(scheduler_output: SchedulerOutput, token_buckets: Sequence[int],
                seq_buckets: Sequence[int]) -> tuple[int, int]:
    """(T, S): the padded shape, so the compiled step, of a scheduled batch."""
    scheduled = scheduler_output.scheduled
    T = pick_bucket(sum(s.num_new_tokens for s in scheduled), token_buckets)
    return T, pick_seq_bucket(T, scheduler_output.num_rows, seq_buckets)


class PageTable:
    """Every page-holding request's page ids as one int32 row (vLLM's block table). The
    KV cache manager reports page lists as they grow and are freed (its `listener`), so a
    step's page table is one gather, not a walk over every request's page list."""

    def __init__(self, pages_per_seq: int, num_rows: int = 64):
        self.table = np.zeros((num_rows, pages_per_seq), np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def extend(self, request: Request, start: int) -> None:
        ids = request.page_ids
        if len(ids) > self.table.shape[1]:  # build_model_inputs' walk reports it
            self.release(request)
            return
        if request.page_row < 0:
            if not self._free_rows:
                self._grow()
            request.page_row = self._free_rows.pop()
            start = 0
        self.table[request.page_row, start:len(ids)] = ids[start:]

    def release(self, request: Request) -> None:
        if request.page_row >= 0:
            self.table[request.page_row] = 0
            self._free_rows.append(request.page_row)
            request.page_row = -1

    def rows(self, scheduled: Sequence[ScheduledSeq], num_padded_seqs: int
             ) -> np.ndarray | None:
        """The step's page table; None if some request has no row here."""
        rows = np.fromiter((s.request.page_row for s in scheduled), np.int64, len(scheduled))
        if len(rows) and rows.min() < 0:
            return None
        page_table = np.zeros((num_padded_seqs, self.table.shape[1]), np.int32)
        np.take(self.table, rows, axis=0, out=page_table[:len(rows)])
        return page_table

    def _grow(self) -> None:
        num_rows = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self._free_rows.extend(range(2 * num_rows - 1, num_rows - 1, -1))


def build_model_inputs(scheduler_output: SchedulerOutput, token_buckets: Sequence[int],
                       seq_buckets: Sequence[int], page_size: int,
                       pages_per_seq: int, prev_rows: Mapping[str, int] | None = None,
                       page_table: PageTable | None = None,
                       bucket: tuple[int, int] | None = None,
                       draft_offsets: Mapping[str, int] | None = None) -> ModelInputs:
    """prev_rows: request id -> its row in the step before, for requests whose last token
    that step sampled is still on the device (Request.num_pending_tokens). page_table:
    the requests' page ids, kept as they change (else read from each request). bucket:
    step_bucket's (T, S), where the caller has it. draft_offsets: request id -> where its
    drafts start in a proposal's flat drafts on the device, which the step reads in place
    of `prev_tokens` (its draft tokens here are placeholders)."""
    scheduled = scheduler_output.scheduled
    num_seqs = len(scheduled)
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    T, S = bucket or step_bucket(scheduler_output, token_buckets, seq_buckets)
    table = None if page_table is None else page_table.rows(scheduled, S)
    if table is None:
        table = _page_table(scheduled, S, pages_per_seq)
    positions, query_start, logits_index, kv_lens, slot_mapping = _layout(
        scheduled, T, S, table, page_size)
    if scheduler_output.num_drafts:
        _draft_rows(scheduled, query_start, logits_index)
    token_ids, prev_index = _token_ids(scheduled, T, num_tokens, logits_index, prev_rows)
    if draft_offsets:
        _device_drafts(scheduled, query_start, prev_index, draft_offsets)
    return ModelInputs(token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                       query_start=query_start, kv_lens=kv_lens, page_table=table,
                       logits_index=logits_index, num_seqs=np.array(num_seqs, np.int32),
                       prev_index=prev_index, lora_slots=_lora_slots(scheduled, T))


def _lora_slots(scheduled, T: int) -> np.ndarray:
    """Each token's adapter slot: its sequence's (zeros when no sequence has one)."""
    slots = np.zeros(T, np.int32)
    if any(s.request.lora_slot for s in scheduled):
        per_seq = np.fromiter((s.request.lora_slot for s in scheduled), np.int32,
                              len(scheduled))
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        slots[:int(num_new.sum())] = np.repeat(per_seq, num_new)
    return slots


def _layout(scheduled, T: int, S: int, table: np.ndarray, page_size: int):
    """Where each token sits: its position, its sequence's chunk (query_start), the row
    whose logits are sampled, each sequence's context after the step, and its KV slot."""
    num_seqs = len(scheduled)
    starts = np.fromiter((s.start for s in scheduled), np.int32, num_seqs)
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    positions = np.zeros(T, np.int32)
    query_start = np.empty(S + 1, np.int32)
    logits_index = np.zeros(S, np.int32)
    kv_lens = np.zeros(S, np.int32)
    if num_tokens == num_seqs:  # decodes: one token each
        seq_of_token = np.arange(num_seqs, dtype=np.int32)
        query_start[:num_seqs + 1] = np.arange(num_seqs + 1, dtype=np.int32)
        query_start[num_seqs + 1:] = num_seqs
        logits_index[:num_seqs] = seq_of_token
        positions[:num_seqs] = starts
        kv_lens[:num_seqs] = starts + 1
    else:
        num_new = np.fromiter((s.num_new_tokens for s in scheduled), np.int32, num_seqs)
        query_start[:] = num_tokens
        query_start[0] = 0
        np.cumsum(num_new, out=query_start[1:num_seqs + 1])
        kv_lens[:num_seqs] = starts + num_new
        logits_index[:num_seqs] = query_start[1:num_seqs + 1] - 1
        # Per-token sequence index and position, without a per-token Python loop.
        seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int32), num_new)
        positions[:num_tokens] = (np.arange(num_tokens, dtype=np.int32)
                                  - query_start[seq_of_token] + starts[seq_of_token])
    slot_mapping = np.zeros(T, np.int32)
    real_positions = positions[:num_tokens]
    pages = table[seq_of_token, real_positions // page_size]
    slot_mapping[:num_tokens] = pages * page_size + real_positions % page_size

    return positions, query_start, logits_index, kv_lens, slot_mapping


def _draft_rows(scheduled, query_start: np.ndarray, logits_index: np.ndarray) -> None:
    """Speculative decoding: a sequence with d draft tokens ends its chunk with them; the
    logits of its d tokens before the last (its committed token, then all drafts but the
    last) predict each draft, in rows of their own after every sequence's row, in batch
    order. The sequence's own row (the chunk's last token) predicts the token after all
    d drafts."""
    row = len(scheduled)
    for i, s in enumerate(scheduled):
        if s.num_drafts:
            first = query_start[i + 1] - 1 - s.num_drafts
            logits_index[row:row + s.num_drafts] = np.arange(first, first + s.num_drafts)
            row += s.num_drafts


def _device_drafts(scheduled, query_start: np.ndarray, prev_index: np.ndarray,
                   offsets: Mapping[str, int]) -> None:
    """Point each sequence's draft tokens (its chunk's last num_drafts) at its drafts in
    the proposal's flat output."""
    for i, s in enumerate(scheduled):
        offset = offsets.get(s.request.request_id)
        if s.num_drafts and offset is not None:
            end = query_start[i + 1]
            prev_index[end - s.num_drafts:end] = np.arange(offset, offset + s.num_drafts)


def _token_ids(scheduled, T: int, num_tokens: int, logits_index: np.ndarray,
               prev_rows: Mapping[str, int] | None) -> tuple[np.ndarray, np.ndarray]:
    """The input ids, and for each id the step before sampled (still on the device) its
    row there (prev_index; -1 elsewhere): the device fills those in."""
    num_seqs = len(scheduled)
    token_ids = np.zeros(T, np.int32)
    prev_index = np.full(T, -1, np.int32)
    all_pending = False
    if prev_rows and num_tokens == num_seqs:
        # A decode step of the overlapped loop: every row's input is most often the token
        # the step before sampled for it (on the device still); one pass finds out.
        rows = np.fromiter((prev_rows.get(s.request.request_id, -1)
                            if s.samples and s.request.num_pending_tokens else -1
                            for s in scheduled), np.int32, num_seqs)
        all_pending = num_seqs > 0 and rows.min() >= 0
        if all_pending:
            prev_index[:num_seqs] = rows
    if all_pending:  # the device fills in every token: token_ids stay 0
        pass
    elif any(s.request.num_pending_tokens for s in scheduled):
        token_ids[:num_tokens] = _tokens_with_pending(scheduled, logits_index, prev_index,
                                                      prev_rows or {})
    else:
        token_ids[:num_tokens] = np.fromiter(
            itertools.chain.from_iterable(
                s.request.tokens(s.start, s.start + s.num_new_tokens) for s in scheduled),
            np.int32, num_tokens)
    return token_ids, prev_index


def _tokens_with_pending(scheduled, logits_index, prev_index, prev_rows) -> list[int]:
    """Known tokens, 0 in place of each pending one (whose prev_index is set)."""
    tokens: list[int] = []
    rows, prev = [], []
    for i, s in enumerate(scheduled):
        request = s.request
        if s.num_new_tokens == 1 and s.samples and request.num_pending_tokens:
            row = prev_rows.get(request.request_id)  # a decode of its pending token
            if row is not None:
                tokens.append(0)
                rows.append(i)
                prev.append(row)
                continue
        stop = s.start + s.num_new_tokens
        known = len(request.prompt_token_ids) + len(request.output_token_ids)
        if stop <= known:
            tokens += request.tokens(s.start, stop)
            continue
        # only the last token of a chunk can be pending, and the step before sampled it
        row = prev_rows.get(request.request_id)
        if stop - known != 1 or row is None:
            raise ValueError(f"request {request.request_id!r}: tokens {known}..{stop} "
                             "are not on the host and no step before sampled them")
        if known > s.start:
            tokens += request.tokens(s.start, known)
        tokens.append(0)
        rows.append(i)
        prev.append(row)
    prev_index[logits_index[rows]] = prev
    return tokens


def _page_table(scheduled, num_padded_seqs: int, pages_per_seq: int) -> np.ndarray:
    """Rows of page ids, zero-filled; one flat fill through a row-major mask."""
    lens = np.fromiter((len(s.request.page_ids) for s in scheduled), np.int64, len(scheduled))
    if len(lens) and lens.max() > pages_per_seq:
        raise ValueError(f"a request holds {lens.max()} pages, more than "
                         f"pages_per_seq={pages_per_seq}")
    page_table = np.zeros((num_padded_seqs, pages_per_seq), np.int32)
    mask = np.arange(pages_per_seq) < lens[:, None]
    page_table[:len(scheduled)][mask] = np.fromiter(
        itertools.chain.from_iterable(s.request.page_ids for s in scheduled),
        np.int32, int(lens.sum()))
    return page_table
