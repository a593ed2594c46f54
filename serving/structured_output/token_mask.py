"""The per-step token bitmask of the constrained rows.

The mask is `TokenMask(active, bits)`: `bits` int32[S, ceil(V / 32)], bit v of row s set
when token v is allowed (llguidance's layout); rows without a constraint are all ones.
Steps without a constrained row pass a device-resident inactive mask instead (see
serving/executor/model_runner.py), so they transfer nothing and the sampler skips the
masking.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from serving.structured_output.grammar import Guide


@dataclasses.dataclass
class TokenMask:
    active: np.ndarray  # bool[]: whether any row is constrained
    bits: np.ndarray  # int32[S, W]


def num_mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def inactive_mask(num_seqs: int, vocab_size: int) -> TokenMask:
    return TokenMask(np.array(False), np.full((num_seqs, num_mask_words(vocab_size)), -1,
                                              np.int32))


class MaskBuilder:
    """Fills the bitmask of the constrained rows of a step on a helper thread (llguidance
    releases the GIL), so the engine builds the batch arrays meanwhile. Rows are filled
    one after another: a row's mask takes tens of microseconds even over 151k tokens,
    less than handing rows to llguidance's thread pool costs."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")

    def submit(self, rows: list[tuple[int, Guide, list[int], list[int]]],
               num_padded_seqs: int):
        """rows: per constrained sequence that samples this step (row index, guide, its
        drafts' rows, its drafts): its row's mask from the guide's state, draft row j's
        after drafts 0..j (speculative decoding; the drafts are within the grammar).
        Returns a future of the TokenMask, or None when no row is constrained."""
        if not rows:
            return None
        return self._pool.submit(self._fill, rows, num_padded_seqs)

    def _fill(self, rows, num_padded_seqs: int) -> TokenMask:
        import llguidance.numpy as llg_numpy
        mask = inactive_mask(num_padded_seqs, self.vocab_size)
        for row, guide, draft_rows, drafts in rows:
            llg_numpy.fill_next_token_bitmask(guide.matcher, mask.bits, row)
            for draft_row, draft in zip(draft_rows, drafts):  # draft j's row follows it
                guide.matcher.consume_token(draft)
                llg_numpy.fill_next_token_bitmask(guide.matcher, mask.bits, draft_row)
            if drafts:  # the guide back where it was; the kept tokens advance it later
                guide.matcher.rollback(len(drafts))
        mask.active = np.array(True)
        return mask
