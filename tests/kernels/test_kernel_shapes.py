"""The kernels' public functions declare their shapes with jaxtyping, in the einsum
alphabet (qwen_jax/layers.py). Here a runtime checker holds every argument and result to
them (jaxtyped + beartype, in tests only: serving pays nothing for the annotations)."""

import numpy as np
import pytest
from beartype import beartype
from jaxtyping import TypeCheckError, jaxtyped

from kernel_cases import INTERPRET, make_case
from pallas_kernels import (
    grouped_matmul,
    grouped_matmul_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_pages,
)


def checked(fn):
    """`fn` (its Python function, under jit's wrapper) with its annotations enforced."""
    return jaxtyped(typechecker=beartype)(getattr(fn, "__wrapped__", fn))


def attention_case():
    return make_case([(3, 9), (1, 5)], num_q_heads=4, num_kv_heads=2, head_dim=16,
                     page_size=4, pages_per_seq=3)


@pytest.mark.parametrize("attention", [ragged_paged_attention, ragged_paged_attention_reference])
def test_attention_shapes_hold(attention):
    case = attention_case()
    out = checked(attention)(*case.args(), sm_scale=0.25, interpret=INTERPRET)
    assert out.shape == case.q.shape


@pytest.mark.parametrize("attention", [ragged_paged_attention, ragged_paged_attention_reference])
def test_attention_rejects_a_query_start_not_one_longer_than_kv_lens(attention):
    q, k_pages, v_pages, kv_lens, page_table, query_start, num_seqs = attention_case().args()
    with pytest.raises(TypeCheckError, match="query_start"):
        checked(attention)(q, k_pages, v_pages, kv_lens, page_table,
                           np.append(query_start, query_start[-1]), num_seqs, sm_scale=0.25)


def test_attention_rejects_pages_of_another_head_dim():
    q, k_pages, v_pages, *rest = attention_case().args()
    with pytest.raises(TypeCheckError, match="k_pages"):
        checked(ragged_paged_attention_reference)(q, k_pages[..., :8], v_pages, *rest,
                                                  sm_scale=0.25)


@pytest.mark.parametrize("matmul", [grouped_matmul, grouped_matmul_reference])
def test_grouped_matmul_shapes_hold_and_depths_must_agree(matmul):
    rng = np.random.default_rng(0)
    lhs = rng.standard_normal((32, 16)).astype(np.float32)
    rhs = rng.standard_normal((3, 16, 48)).astype(np.float32)
    sizes = np.array([10, 0, 20], np.int32)
    out = checked(matmul)(lhs, rhs, sizes, interpret=INTERPRET)
    assert out.shape == (32, 48)
    with pytest.raises(TypeCheckError, match="rhs"):
        checked(matmul)(lhs, rhs[:, :8], sizes, interpret=INTERPRET)


def test_write_kv_pages_shapes_hold_and_heads_must_agree():
    case = attention_case()
    new = np.ones((5, 2, 16), np.float32)  # [T, K, H]
    slots = np.arange(5, dtype=np.int32)
    k_pages, v_pages = checked(write_kv_pages)(case.k_pages, case.v_pages, new, new, slots)
    assert k_pages.shape == v_pages.shape == case.k_pages.shape
    with pytest.raises(TypeCheckError, match="k_new"):
        checked(write_kv_pages)(case.k_pages, case.v_pages, new[:, :1], new, slots)
