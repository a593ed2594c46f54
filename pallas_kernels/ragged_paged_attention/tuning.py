"""Block sizes for the ragged paged attention kernel, keyed by shape.

A key is (step kind, query heads per kv head, head dim); "decode" is a step whose query
rows are at most one per sequence slot. Triton's `tl.dot` needs every tile dim >= 16, so
`block_q * group` (the tile's query rows: `block_q` tokens times the group's heads) is
kept >= 16. Entries are starting points chosen by reasoning, not measured on an H200 yet.
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


def attention_blocks(*, num_tokens, num_seqs_max, group, head_dim):
    """Tuned blocks for this shape, or a rule-of-thumb fallback for shapes not in the table."""
    kind = "decode" if num_tokens <= num_seqs_max else "prefill"
    tuned = _TABLE.get((kind, group, head_dim))
    if tuned is not None:
        return tuned
    rows = 16 if kind == "decode" else 64
    return AttentionBlocks(block_q=max(1, rows // group), block_k=64, num_warps=4,
                           num_stages=2)
