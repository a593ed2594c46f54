"""Argument checks for ragged paged attention: every error names the argument and shape."""

import jax.numpy as jnp

_QUANTIZED = (jnp.int8, jnp.float8_e4m3fn, jnp.float8_e5m2)


def _fail(name, value, expected):
    raise ValueError(f"{name} has shape {tuple(value.shape)}, expected {expected}")


def check_attention_args(q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs,
                         k_scale, v_scale):
    """Raises ValueError when the shapes or dtypes break the kernel's contract."""
    if q.ndim != 3:
        _fail("q", q, "[T, N, H]")
    if k_pages.ndim != 4:
        _fail("k_pages", k_pages, "[P, L, K, H]")
    if v_pages.shape != k_pages.shape:
        _fail("v_pages", v_pages, f"k_pages' shape {tuple(k_pages.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[2]
    if k_pages.shape[3] != head_dim:
        _fail("k_pages", k_pages, f"head dim {head_dim} (q's last dim)")
    if num_q_heads % num_kv_heads:
        _fail("q", q, f"a head count divisible by k_pages' {num_kv_heads} kv heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        _fail("q", q, "a head dim that is a power of two >= 16 (Triton tiles)")
    if kv_lens.ndim != 1:
        _fail("kv_lens", kv_lens, "[S]")
    num_seqs_max = kv_lens.shape[0]
    if page_table.ndim != 2 or page_table.shape[0] != num_seqs_max:
        _fail("page_table", page_table, f"[{num_seqs_max}, pages_per_seq]")
    if query_start.shape != (num_seqs_max + 1,):
        _fail("query_start", query_start, f"({num_seqs_max + 1},) = S + 1")
    if jnp.shape(num_seqs) != ():
        _fail("num_seqs", jnp.asarray(num_seqs), "a scalar")
    quantized = k_pages.dtype in _QUANTIZED
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is not None and scale.shape != (num_kv_heads,):
            _fail(name, scale, f"({num_kv_heads},), one scale per kv head")
        if quantized and scale is None:
            raise ValueError(f"{name} is required: k_pages hold {k_pages.dtype}")


def _is_tile(size, minimum):
    return size >= minimum and not size & (size - 1)


def check_attention_blocks(*, block_q, block_k, group):
    """Triton tiles are powers of two and `tl.dot` needs every tile dim >= 16."""
    if not _is_tile(block_q, 1) or not _is_tile(block_q * group, 16):
        raise ValueError(f"block_q is {block_q}, expected a power of two with block_q * "
                         f"group >= 16 (group = {group} query heads per kv head, padded)")
    if not _is_tile(block_k, 16):
        raise ValueError(f"block_k is {block_k}, expected a power of two >= 16")
