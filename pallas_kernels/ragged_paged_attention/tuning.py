"""Block sizes for the ragged paged attention kernel, keyed by shape.

A key is (step kind, query heads per kv head, head dim); "decode" is a step whose query
rows are at most one per sequence slot (or at most 16). Triton's `tl.dot` needs every
tile dim >= 16, so `block_q * group` (the tile's query rows: `block_q` tokens times the
group's heads) is kept >= 16. Decode steps of few sequences also split each sequence's
keys (`decode_splits`). Entries are starting points chosen by reasoning, not measured on
an H200 yet.
"""

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionBlocks:
    block_q: int     # query tokens per program (times `group` heads = tile rows)
    block_k: int     # keys per inner-loop step, gathered across pages
    num_warps: int
    num_stages: int


# Decode is bandwidth bound: the smallest legal q tile and long key blocks.
# Prefill is compute bound: 64-128 row tiles amortise each key block load (128 rows and
# 8 warps at head dim 128, as in Triton's flash-attention tutorial configs for sm90).
_TABLE = {
    ("decode", 1, 64): AttentionBlocks(block_q=16, block_k=64, num_warps=4, num_stages=3),
    ("decode", 1, 128): AttentionBlocks(block_q=16, block_k=64, num_warps=4, num_stages=3),
    ("decode", 4, 64): AttentionBlocks(block_q=4, block_k=64, num_warps=4, num_stages=3),
    ("decode", 4, 128): AttentionBlocks(block_q=4, block_k=64, num_warps=4, num_stages=3),
    ("decode", 8, 64): AttentionBlocks(block_q=2, block_k=64, num_warps=4, num_stages=3),
    ("decode", 8, 128): AttentionBlocks(block_q=2, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 1, 64): AttentionBlocks(block_q=64, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 1, 128): AttentionBlocks(block_q=128, block_k=64, num_warps=8, num_stages=3),
    ("prefill", 4, 64): AttentionBlocks(block_q=16, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 4, 128): AttentionBlocks(block_q=32, block_k=64, num_warps=8, num_stages=3),
    ("prefill", 8, 64): AttentionBlocks(block_q=8, block_k=64, num_warps=4, num_stages=3),
    ("prefill", 8, 128): AttentionBlocks(block_q=16, block_k=64, num_warps=8, num_stages=3),
}


# A step of at most this many tokens (the smallest token buckets) is a decode step even
# when its sequence bucket is smaller: batch 1 runs in the (8 tokens, 4 sequences) bucket.
_DECODE_TOKENS = 16
# Flash-decoding: split each sequence's keys until sequences x kv heads x splits reaches
# this many programs (about two per SM of an H200), at most _MAX_SPLITS ways.
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 16


def step_kind(*, num_tokens, num_seqs_max) -> str:
    return "decode" if num_tokens <= max(num_seqs_max, _DECODE_TOKENS) else "prefill"


def decode_splits(*, num_tokens, num_seqs_max, num_kv_heads) -> int:
    """Key splits per (sequence, kv head) of a decode step; 1 for prefill steps.

    At batch 1 a decode step has one program per kv head (4 for Qwen3-30B-A3B) on 132
    SMs; 16 splits give 64 programs each reading 1/16 of the context. From 64 sequences
    on the sequences alone fill the machine and splitting only adds the combine."""
    if step_kind(num_tokens=num_tokens, num_seqs_max=num_seqs_max) != "decode":
        return 1
    programs = max(1, num_seqs_max * num_kv_heads)
    splits = 1 << max(0, (_TARGET_PROGRAMS // programs).bit_length() - 1)
    return min(_MAX_SPLITS, splits)


def attention_blocks(*, num_tokens, num_seqs_max, group, head_dim):
    """Tuned blocks for this shape, or a rule-of-thumb fallback for shapes not in the table."""
    kind = step_kind(num_tokens=num_tokens, num_seqs_max=num_seqs_max)
    tuned = _TABLE.get((kind, group, head_dim))
    if tuned is not None:
        return tuned
    rows = 16 if kind == "decode" else 64
    return AttentionBlocks(block_q=max(1, rows // group), block_k=64, num_warps=4,
                           num_stages=2)
