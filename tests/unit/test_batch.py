"""Padded ragged ModelInputs for a mixed prefill + decode step."""

import dataclasses

import numpy as np
import pytest

from serving.core.request import Request
from serving.core.scheduler_output import ScheduledSeq, SchedulerOutput
from serving.executor.model_inputs import build_model_inputs

BS = 4
PAGES = 4


def seq(rid, tokens, page_ids, start, num_new):
    request = Request(rid, list(tokens))
    request.page_ids = list(page_ids)
    return ScheduledSeq(request, num_new, start, start + num_new == request.num_tokens)


@pytest.fixture
def mixed():
    """A decode (position 5), a first prefill chunk (3 of 9) and a full prefill (2)."""
    decode = seq("d", range(10, 16), [7, 3], start=5, num_new=1)
    chunk = seq("c", range(20, 29), [5, 6, 8], start=0, num_new=3)
    prefill = seq("p", [40, 41], [2], start=0, num_new=2)
    out = SchedulerOutput(scheduled=[decode, chunk, prefill], preempted=[])
    return build_model_inputs(out, token_buckets=[8, 16], seq_buckets=[4, 8],
                              page_size=BS, pages_per_seq=PAGES)


def test_picks_smallest_buckets_that_fit(mixed):
    assert mixed.bucket == (8, 4) and mixed.num_tokens == 6 and int(mixed.num_seqs) == 3
    assert mixed.num_seqs.shape == () and mixed.num_seqs.dtype == np.int32


def test_all_arrays_are_int32(mixed):
    device_fields = [f.name for f in dataclasses.fields(mixed) if f.name != "num_tokens"]
    assert all(getattr(mixed, name).dtype == np.int32 for name in device_fields)
    assert isinstance(mixed.num_tokens, int)  # host-side only


def test_tokens_and_positions_per_sequence(mixed):
    assert mixed.token_ids.tolist() == [15, 20, 21, 22, 40, 41, 0, 0]
    assert mixed.positions.tolist() == [5, 0, 1, 2, 0, 1, 0, 0]


def test_slot_mapping_follows_page_table_and_padding_goes_to_page_zero(mixed):
    # position 5 of "d" is page 3 offset 1; "c" fills page 5; "p" page 2.
    assert mixed.slot_mapping.tolist() == [3 * BS + 1, 20, 21, 22, 8, 9, 0, 0]
    assert (mixed.slot_mapping[mixed.num_tokens:] // BS == 0).all()


def test_query_start_repeats_last_value_for_padding_sequences(mixed):
    assert mixed.query_start.tolist() == [0, 1, 4, 6, 6]


def test_kv_lens_zero_for_padding(mixed):
    assert mixed.kv_lens.tolist() == [6, 3, 2, 0]


def test_page_table_zero_filled(mixed):
    assert mixed.page_table.shape == (4, PAGES)
    assert mixed.page_table.tolist() == [[7, 3, 0, 0], [5, 6, 8, 0], [2, 0, 0, 0], [0, 0, 0, 0]]


def test_logits_index_points_at_last_token_of_each_chunk(mixed):
    assert mixed.logits_index.tolist() == [0, 3, 5, 0]


def test_decode_only_batch_of_many_sequences():
    seqs = [seq(f"r{i}", range(i, i + 9), [i + 1, i + 2, i + 3], start=8, num_new=1)
            for i in range(5)]
    inputs = build_model_inputs(SchedulerOutput(seqs, []), [8, 16], [4, 8], BS, PAGES)
    assert inputs.bucket == (8, 8)
    assert inputs.positions[:5].tolist() == [8] * 5
    assert inputs.slot_mapping[:5].tolist() == [(i + 3) * BS for i in range(5)]
    assert inputs.logits_index.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert inputs.query_start.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]


def test_too_many_pages_for_the_table_is_an_error():
    s = seq("x", range(20), [1, 2, 3, 4, 5], start=0, num_new=17)
    with pytest.raises(ValueError, match="pages_per_seq=4"):
        build_model_inputs(SchedulerOutput([s], []), [32], [4], BS, PAGES)


def test_too_many_tokens_for_the_buckets_is_an_error():
    s = seq("x", range(20), [1, 2, 3, 4, 5], start=0, num_new=20)
    with pytest.raises(ValueError, match="exceeds the largest bucket 16"):
        build_model_inputs(SchedulerOutput([s], []), [8, 16], [4], BS, 8)


def test_page_table_mirrors_page_lists_through_admissions_preemptions_and_finishes():
    """The engine's PageTable (fed by the KV cache manager) gives the same step page table
    as walking the requests' page lists, on a pool small enough to preempt, with prefix
    hits and finished requests; and only rows of page-holding requests stay taken."""
    import random

    from serving.core.config import SchedulerConfig
    from serving.core.kv_cache_manager import KVCacheManager
    from serving.core.request import RequestStatus, SamplingParams
    from serving.core.scheduler import Scheduler
    from serving.executor.model_inputs import PageTable, _page_table

    rng = random.Random(0)
    pages_per_seq = 16
    kv = KVCacheManager(num_pages=24, page_size=BS)
    table = PageTable(pages_per_seq, num_rows=2)  # grows past 2 rows
    kv.listener = table
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24,
                                          max_model_len=pages_per_seq * BS, kv_plan_limit=1.0,
                                          watermark=0.0), kv)
    shared = [rng.randrange(100) for _ in range(8)]  # a common prefix: prefix-cache hits
    num_preempted = 0
    for i in range(12):
        prompt = shared + [rng.randrange(100) for _ in range(rng.randrange(1, 20))]
        scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=12)))
    for _ in range(200):
        out = scheduler.schedule()
        if out.is_empty:
            break
        num_preempted += len(out.preempted)
        expected = _page_table(out.scheduled, 8, pages_per_seq)
        assert np.array_equal(table.rows(out.scheduled, 8), expected)
        scheduler.update_after_step(out)
        for s in out.scheduled:
            if s.samples:
                s.request.append_output_token(rng.randrange(100))
                if scheduler.is_length_capped(s.request) or rng.random() < 0.05:
                    scheduler.finish(s.request.request_id, RequestStatus.FINISHED_STOPPED)
    assert not scheduler.has_unfinished and num_preempted > 0
    assert kv.pool.num_free_pages == kv.num_total_pages and not table.table.any()
    assert sorted(table._free_rows) == list(range(table.table.shape[0]))


def test_decodes_whose_tokens_are_still_on_the_device():
    """The overlapped loop's decode step: a row whose token the step before sampled (still
    pending) reads it from that step's row (prev_index, token 0); when one row's token is on
    the host instead, it gets that token and the others still point at their rows."""
    def decodes():
        seqs = [seq(f"r{i}", range(10 * i, 10 * i + 9), [i + 1, i + 2, i + 3], start=8,
                    num_new=1) for i in range(3)]
        for s in seqs:  # token 8 (the 9th) was sampled by the step before, not read yet
            s.request.prompt_token_ids.pop()
            s.request.num_pending_tokens = 1
        return seqs

    seqs = decodes()
    prev_rows = {"r0": 2, "r1": 0, "r2": 1}
    inputs = build_model_inputs(SchedulerOutput(seqs, []), [8], [4], BS, PAGES, prev_rows)
    assert inputs.token_ids.tolist() == [0] * 8
    assert inputs.prev_index.tolist() == [2, 0, 1] + [-1] * 5
    assert inputs.positions[:3].tolist() == [8, 8, 8] and inputs.kv_lens.tolist() == [9] * 3 + [0]

    seqs = decodes()
    seqs[1].request.prompt_token_ids.append(18)  # r1's token reached the host
    seqs[1].request.num_pending_tokens = 0
    seqs[1] = ScheduledSeq(seqs[1].request, 1, 8, True)
    inputs = build_model_inputs(SchedulerOutput(seqs, []), [8], [4], BS, PAGES, prev_rows)
    assert inputs.token_ids.tolist() == [0, 18, 0] + [0] * 5
    assert inputs.prev_index.tolist() == [2, -1, 1] + [-1] * 5
