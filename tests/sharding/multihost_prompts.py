"""Shared by the two-process test and its workers."""

PROMPTS = [[5, 9, 33], list(range(2, 40)), [71] * 11]
ARGS = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, token_buckets=[64],
            seq_buckets=[4], show_progress=False, compilation_cache_dir=None)
