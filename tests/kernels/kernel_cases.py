"""Random ragged paged-attention cases and a naive numpy oracle shared by the kernel tests."""

import dataclasses

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionCase:
    q: np.ndarray            # [T, N, H]
    k_pages: np.ndarray      # [P, L, K, H]
    v_pages: np.ndarray      # [P, L, K, H]
    kv_lens: np.ndarray      # int32[S]
    page_table: np.ndarray   # int32[S, pages_per_seq]
    query_start: np.ndarray  # int32[S+1]
    num_seqs: np.ndarray     # int32 scalar
    k_scale: np.ndarray | None = None  # float32[K]
    v_scale: np.ndarray | None = None  # float32[K]

    def args(self):
        return (self.q, self.k_pages, self.v_pages, self.kv_lens, self.page_table,
                self.query_start, self.num_seqs)


def make_case(seqs, *, num_q_heads, num_kv_heads, head_dim, page_size, pages_per_seq,
              dtype=np.float32, kv_dtype=None, num_pad_seqs=0, num_pad_tokens=0, seed=0):
    """seqs: list of (q_len, kv_len). Pages are drawn as a random permutation so every
    sequence's pages are scattered across the cache, never contiguous."""
    rng = np.random.default_rng(seed)
    num_real = len(seqs)
    num_seqs_max = num_real + num_pad_seqs
    num_pages = num_seqs_max * pages_per_seq + 3
    q_lens = [q for q, _ in seqs]
    query_start = np.zeros(num_seqs_max + 1, np.int32)
    query_start[1:num_real + 1] = np.cumsum(q_lens)
    query_start[num_real + 1:] = query_start[num_real]
    num_tokens = int(query_start[-1]) + num_pad_tokens
    kv_lens = np.zeros(num_seqs_max, np.int32)
    kv_lens[:num_real] = [kv for _, kv in seqs]
    assert all(q <= kv <= pages_per_seq * page_size for q, kv in seqs)
    page_table = rng.permutation(num_pages)[:num_seqs_max * pages_per_seq]
    page_table = page_table.reshape(num_seqs_max, pages_per_seq).astype(np.int32)
    q = rng.standard_normal((num_tokens, num_q_heads, head_dim)).astype(dtype)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_scale = v_scale = None
    if kv_dtype is None:
        k_pages = rng.standard_normal(shape).astype(dtype)
        v_pages = rng.standard_normal(shape).astype(dtype)
    elif kv_dtype == np.int8:
        k_pages = rng.integers(-127, 128, shape).astype(np.int8)
        v_pages = rng.integers(-127, 128, shape).astype(np.int8)
        k_scale = rng.uniform(0.5, 2.0, num_kv_heads).astype(np.float32) / 127
        v_scale = rng.uniform(0.5, 2.0, num_kv_heads).astype(np.float32) / 127
    else:
        k_pages = rng.standard_normal(shape).astype(kv_dtype)
        v_pages = rng.standard_normal(shape).astype(kv_dtype)
        k_scale = rng.uniform(0.5, 2.0, num_kv_heads).astype(np.float32)
        v_scale = rng.uniform(0.5, 2.0, num_kv_heads).astype(np.float32)
    return AttentionCase(q=q, k_pages=k_pages, v_pages=v_pages, kv_lens=kv_lens,
                         page_table=page_table, query_start=query_start,
                         num_seqs=np.int32(num_real), k_scale=k_scale, v_scale=v_scale)


def naive_attention(case, *, sm_scale):
    """Loop over sequences, tokens and heads in float64 numpy: the independent oracle."""
    q = case.q.astype(np.float64)
    k_pages = case.k_pages.astype(np.float64)
    v_pages = case.v_pages.astype(np.float64)
    if case.k_scale is not None:
        k_pages = k_pages * case.k_scale[None, None, :, None]
        v_pages = v_pages * case.v_scale[None, None, :, None]
    page_size, num_kv_heads = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for s in range(int(case.num_seqs)):
        start, stop = case.query_start[s], case.query_start[s + 1]
        kv_len = case.kv_lens[s]
        keys = np.stack([k_pages[case.page_table[s, p // page_size], p % page_size]
                         for p in range(kv_len)])                         # [C, K, H]
        values = np.stack([v_pages[case.page_table[s, p // page_size], p % page_size]
                           for p in range(kv_len)])                       # [C, K, H]
        for i, row in enumerate(range(start, stop)):
            pos = kv_len - (stop - start) + i
            for n in range(q.shape[1]):
                scores = keys[:pos + 1, n // group] @ q[row, n] * sm_scale
                probs = np.exp(scores - scores.max())
                out[row, n] = probs / probs.sum() @ values[:pos + 1, n // group]
    return out


def as_float(x):
    return np.asarray(x).astype(np.float32)


BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn


def run_interpreted():
    """Kernels run interpreted on CPU and compiled on GPUs.

    PALLAS_KERNELS_INTERPRET=1 / 0 forces either; unset, the backend decides."""
    import os

    import jax

    forced = os.environ.get("PALLAS_KERNELS_INTERPRET")
    if forced is not None:
        return forced not in ("0", "false", "False")
    return jax.default_backend() != "gpu"


INTERPRET = run_interpreted()


def passed_whole(text: str, tensor_type: str) -> bool:
    """Whether every line of a lowered module that mentions `tensor_type` (an operand's
    type, e.g. "tensor<48x128x2048x1536xbf16>") is a function signature or a call: the
    array reaches the kernel as it is, never sliced, gathered or copied by XLA."""
    lines = [line for line in text.splitlines() if tensor_type in line]
    return bool(lines) and all("func.func" in line or "call @" in line for line in lines)


def record_tma_stores(monkeypatch) -> list:
    """The row counts of the Mosaic GPU kernels' TMA stores traced from now on (appended
    to the returned list as they are traced)."""
    from pallas_kernels import mosaic_support

    rows, copy = [], mosaic_support.plgpu.copy_smem_to_gmem

    def recording(src, dst, *args, **kwargs):
        rows.append(dst.shape[0])
        return copy(src, dst, *args, **kwargs)

    monkeypatch.setattr(mosaic_support.plgpu, "copy_smem_to_gmem", recording)
    return rows
