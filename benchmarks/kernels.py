"""Kernel benchmarks on Qwen3-30B-A3B shapes, each side by side with its reference path.

Prints one JSON object: achieved HBM GB/s for decode attention and the KV page write,
TFLOP/s for prefill attention and the expert grouped matmul (plus ragged_dot and a dense
matmul of the same FLOPs). Off GPU it runs tiny shapes with the kernels interpreted, only
to prove the script works: those numbers mean nothing.

    python benchmarks/kernels.py [--small] [--out FILE]
"""

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    grouped_matmul,
    grouped_matmul_reference,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    write_kv_pages,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    page_size: int = 16
    decode_batch: int = 64
    decode_context: int = 2048
    prefill_seqs: int = 4
    prefill_len: int = 2048
    num_experts: int = 128
    hidden: int = 2048
    expert_ffn: int = 768
    routed_rows: int = 8192  # 1024 tokens x top-8
    iters: int = 20


SMALL = Shapes(num_q_heads=8, num_kv_heads=2, head_dim=64, decode_batch=4,
               decode_context=64, prefill_seqs=2, prefill_len=32, num_experts=8,
               hidden=64, expert_ffn=32, routed_rows=128, iters=2)


def timed(fn, *args, iters):
    """Seconds per call: calls are queued back to back, so dispatch overlaps the device."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def paged_cache(rng, shapes, *, num_seqs, context):
    """Random bf16 pages with each sequence's pages scattered over the cache."""
    pages_per_seq = -(-context // shapes.page_size)
    num_pages = num_seqs * pages_per_seq + 1
    shape = (num_pages, shapes.page_size, shapes.num_kv_heads, shapes.head_dim)
    k_pages = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    v_pages = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    page_table = rng.permutation(num_pages)[:num_seqs * pages_per_seq]
    return k_pages, v_pages, jnp.asarray(page_table.reshape(num_seqs, -1), jnp.int32)


def attention_args(rng, shapes, *, num_seqs, q_len, context):
    k_pages, v_pages, page_table = paged_cache(rng, shapes, num_seqs=num_seqs,
                                               context=context)
    q = jnp.asarray(rng.standard_normal((num_seqs * q_len, shapes.num_q_heads,
                                         shapes.head_dim)), jnp.bfloat16)
    kv_lens = jnp.full((num_seqs,), context, jnp.int32)
    query_start = jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len
    return q, k_pages, v_pages, kv_lens, page_table, query_start, jnp.int32(num_seqs)


def bench_attention(rng, shapes, interpret):
    """Decode: HBM GB/s over the KV bytes read; prefill: causal TFLOP/s."""
    sm_scale = shapes.head_dim ** -0.5
    kernel = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=sm_scale,
                                                       interpret=interpret))
    reference = jax.jit(lambda *a: ragged_paged_attention_reference(*a, sm_scale=sm_scale))
    results = {}
    args = attention_args(rng, shapes, num_seqs=shapes.decode_batch, q_len=1,
                          context=shapes.decode_context)
    kv_bytes = 2 * 2 * shapes.decode_batch * shapes.decode_context * shapes.num_kv_heads \
        * shapes.head_dim
    for name, fn in (("pallas", kernel), ("reference", reference)):
        seconds = timed(fn, *args, iters=shapes.iters)
        results[f"decode_{name}"] = {"ms": seconds * 1e3, "hbm_gbps": kv_bytes / seconds / 1e9}
    args = attention_args(rng, shapes, num_seqs=shapes.prefill_seqs, q_len=shapes.prefill_len,
                          context=shapes.prefill_len)
    # Two matmuls (QK^T, PV) of 2 flops per MAC over the causally visible keys.
    visible = shapes.prefill_seqs * shapes.prefill_len * (shapes.prefill_len + 1) / 2
    flops = 4 * visible * shapes.num_q_heads * shapes.head_dim
    for name, fn in (("pallas", kernel), ("reference", reference)):
        seconds = timed(fn, *args, iters=max(1, shapes.iters // 4))
        results[f"prefill_{name}"] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
    return results


def routed_group_sizes(rng, shapes):
    """Expert row counts of random top-k routing (each token picks distinct experts)."""
    top_k = 8 if shapes.num_experts >= 8 else 1
    num_tokens = shapes.routed_rows // top_k
    choices = np.argsort(rng.random((num_tokens, shapes.num_experts)), axis=1)[:, :top_k]
    return jnp.asarray(np.bincount(choices.ravel(), minlength=shapes.num_experts), jnp.int32)


def bench_grouped_matmul(rng, shapes, interpret):
    """Expert gate/up and down projections: TFLOP/s, and GB/s over the weights read."""
    sizes = routed_group_sizes(rng, shapes)
    kernel = jax.jit(lambda *a: grouped_matmul(*a, interpret=interpret))
    reference = jax.jit(grouped_matmul_reference)
    dense = jax.jit(lambda lhs, rhs: jnp.dot(lhs, rhs, preferred_element_type=jnp.float32
                                             ).astype(lhs.dtype))
    results = {}
    for proj, depth, width in (("gate_up", shapes.hidden, 2 * shapes.expert_ffn),
                               ("down", shapes.expert_ffn, shapes.hidden)):
        lhs = jnp.asarray(rng.standard_normal((shapes.routed_rows, depth)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((shapes.num_experts, depth, width)) / 32,
                          jnp.bfloat16)
        flops = 2 * shapes.routed_rows * depth * width
        weight_bytes = 2 * rhs.size
        for name, fn, args in (("pallas", kernel, (lhs, rhs, sizes)),
                               ("ragged_dot", reference, (lhs, rhs, sizes)),
                               ("dense_same_flops", dense, (lhs, rhs[0]))):
            seconds = timed(fn, *args, iters=shapes.iters)
            entry = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12}
            if name != "dense_same_flops":
                entry["weight_gbps"] = weight_bytes / seconds / 1e9
            results[f"{proj}_{name}"] = entry
        results[f"{proj}_pallas_vs_ragged_dot"] = (
            results[f"{proj}_ragged_dot"]["ms"] / results[f"{proj}_pallas"]["ms"])
        results[f"{proj}_pallas_vs_dense"] = (
            results[f"{proj}_dense_same_flops"]["ms"] / results[f"{proj}_pallas"]["ms"])
    return results


def bench_kv_write(rng, shapes):
    """One decode step's K/V rows scattered into a donated cache: GB/s over rows written."""
    k_pages, v_pages, page_table = paged_cache(rng, shapes, num_seqs=shapes.decode_batch,
                                               context=shapes.decode_context)
    new = jnp.asarray(rng.standard_normal((shapes.decode_batch, shapes.num_kv_heads,
                                           shapes.head_dim)), jnp.bfloat16)
    slots = page_table[:, -1] * shapes.page_size + shapes.page_size - 1
    write = jax.jit(write_kv_pages, donate_argnums=(0, 1))
    k_pages, v_pages = jax.block_until_ready(write(k_pages, v_pages, new, new, slots))
    start = time.perf_counter()
    for _ in range(shapes.iters):
        k_pages, v_pages = write(k_pages, v_pages, new, new, slots)
    jax.block_until_ready(k_pages)
    seconds = (time.perf_counter() - start) / shapes.iters
    return {"kv_write_xla_scatter": {"ms": seconds * 1e3,
                                     "hbm_gbps": 2 * 2 * 2 * new.size / seconds / 1e9}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (default off GPU)")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    shapes = SMALL if args.small or not on_gpu else Shapes()
    rng = np.random.default_rng(0)
    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "interpret": not on_gpu, "shapes": dataclasses.asdict(shapes)}
    report.update(bench_attention(rng, shapes, interpret=not on_gpu))
    report.update(bench_grouped_matmul(rng, shapes, interpret=not on_gpu))
    report.update(bench_kv_write(rng, shapes))
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
