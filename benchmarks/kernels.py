"""Kernel checks and timings at Qwen3-30B-A3B shapes, one JSON line per result, printed
(and appended to --out) the moment it is measured, so a run cut short keeps its figures.

- check: each kernel against its jnp reference (relative error, bf16 tolerance 2e-2)
- attention: decode HBM GB/s over the KV bytes read at 1 / 8 / 64 sequences of 1k
  context; prefill TFLOP/s of a 2k-token chunk, Triton and Mosaic GPU kernels
- grouped matmul (the MoE call form: rows read through lhs_rows, stacked weights):
  GB/s over the weights of the experts actually touched at 1 / 8 / 64 decode tokens and
  a 2k prefill, TFLOP/s over the real rows, each candidate implementation (Triton;
  Mosaic GPU at prefill sizes; XLA's ragged_dot only up to 512 rows: XLA computes every
  group densely, seconds per call at 16k rows); the decode
  cases also with fp8 (128 x 128 blocks) and int4 (AWQ, groups of 128) expert weights:
  GB/s over their stored bytes, `vs_bf16` the speed-up, `rel_err` against the reference
- stacked matmul (q/k/v in one launch, o_proj): weight GB/s at decode, TFLOP/s at prefill
- KV page write: GB/s over the rows written

Each timing of the attention and grouped matmul carries its `op`, `size` and `impl`:
`pallas_kernels.choices.fastest` makes the kernel table of them (the device probe writes
it to OUT/kernel_table.json; `qwen-jax serve --kernel-table` reads it).

Off GPU the kernels run interpreted on tiny shapes (`--small`), only to prove the
script works: those numbers mean nothing.

    python benchmarks/kernels.py [--small] [--out FILE] [--parts check,attention,...]
"""

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import (
    grouped_matmul,
    grouped_matmul_reference,
    plan_groups,
    ragged_paged_attention,
    ragged_paged_attention_reference,
    stacked_matmul,
    stacked_matmul_reference,
    write_kv_pages,
)
from pallas_kernels.choices import CANDIDATES
from pallas_kernels.grouped_matmul import tuning as gmm_tuning
from pallas_kernels.quantized import QuantizedWeight, quantize


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shapes:
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    page_size: int = 16
    context: int = 1024
    decode_seqs: tuple = (1, 8, 64)
    prefill_tokens: int = 2048
    num_experts: int = 128
    top_k: int = 8
    hidden: int = 2048
    expert_ffn: int = 768
    token_buckets: tuple = (8, 8, 64)  # the step's bucket for 1 / 8 / 64 decode tokens
    iters: int = 20
    ragged_dot_max_rows: int = 512
    weight_formats: tuple = ("bf16", "fp8", "int4")  # expert weights of the decode cases
    int4_group: int = 128  # AWQ's group_size


SMALL = Shapes(num_q_heads=8, num_kv_heads=2, head_dim=64, context=64, decode_seqs=(1, 4),
               prefill_tokens=32, num_experts=8, top_k=2, hidden=64, expert_ffn=32,
               token_buckets=(8, 8), iters=2, int4_group=32)
TOLERANCE = 2e-2  # bf16


def timed(fn, *args, iters):
    """Seconds per call: calls are queued back to back, so dispatch overlaps the device."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def rel_err(out, expected):
    out, expected = (np.asarray(a, np.float32) for a in (out, expected))
    return float(np.linalg.norm(out - expected) / max(np.linalg.norm(expected), 1e-30))


def attention_case(rng, shapes, *, num_seqs, q_len, context, kv_dtype=jnp.bfloat16):
    """bf16 queries; pages of each sequence scattered over the cache (page 0 unused)."""
    pages_per_seq = -(-context // shapes.page_size)
    num_pages = num_seqs * pages_per_seq + 1
    shape = (num_pages, shapes.page_size, shapes.num_kv_heads, shapes.head_dim)
    pages = [jnp.asarray(rng.standard_normal(shape), kv_dtype) for _ in range(2)]
    table = 1 + rng.permutation(num_pages - 1)[:num_seqs * pages_per_seq]
    q = jnp.asarray(rng.standard_normal((num_seqs * q_len, shapes.num_q_heads,
                                         shapes.head_dim)), jnp.bfloat16)
    return (q, *pages, jnp.full((num_seqs,), context, jnp.int32),
            jnp.asarray(table.reshape(num_seqs, -1), jnp.int32),
            jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len, jnp.int32(num_seqs))


def moe_case(rng, shapes, num_tokens, bucket):
    """Top-k routing of num_tokens real tokens in a bucket of `bucket` tokens: the step's
    gate/up call (rows read through lhs_rows). Returns (args, kwargs, experts touched)."""
    top_k, num_experts = shapes.top_k, shapes.num_experts
    ids = np.full((bucket, top_k), num_experts)  # padding tokens: past every expert
    ids[:num_tokens] = np.argsort(rng.random((num_tokens, num_experts)), axis=1)[:, :top_k]
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    ends = (flat[:, None] <= np.arange(num_experts)[None, :]).sum(0).astype(np.int32)
    rows = len(flat)
    plan = plan_groups(jnp.asarray(ends), num_rows=rows,
                       block_m=gmm_tuning.block_m_for(num_rows=rows, num_groups=num_experts))
    x = jnp.asarray(rng.standard_normal((bucket, shapes.hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1, num_experts, shapes.hidden, 2 * shapes.expert_ffn))
                    / 32, jnp.bfloat16)
    kwargs = dict(plan=plan, layer=jnp.int32(0), lhs_rows=jnp.asarray(order // top_k))
    return (x, w), kwargs, int(len(set(flat[flat < num_experts])))


def checks(rng, shapes, interpret):
    """Each kernel against its reference on the device."""
    sm_scale = shapes.head_dim ** -0.5
    for name, num_seqs, q_len, kv_dtype in (("attention_decode", 3, 1, jnp.bfloat16),
                                            ("attention_decode_fp8", 3, 1, jnp.float8_e4m3fn),
                                            ("attention_prefill", 2, 48, jnp.bfloat16)):
        args = attention_case(rng, shapes, num_seqs=num_seqs, q_len=q_len,
                              context=min(200, shapes.context), kv_dtype=kv_dtype)
        scales = {}
        if kv_dtype != jnp.bfloat16:
            ones = jnp.ones((shapes.num_kv_heads,), jnp.float32)
            scales = dict(k_scale=ones, v_scale=ones)
        out = jax.jit(functools.partial(ragged_paged_attention, sm_scale=sm_scale, **scales,
                                        interpret=interpret))(*args)
        ref = jax.jit(functools.partial(ragged_paged_attention_reference, sm_scale=sm_scale,
                                        **scales))(*args)
        yield _check(name, out, ref)
    (x, w), kwargs, _ = moe_case(rng, shapes, 5, 8)
    out = grouped_matmul(x, w, interpret=interpret, **kwargs)
    yield _check("grouped_matmul_moe", out, grouped_matmul_reference(x, w, **kwargs))
    x = jnp.asarray(rng.standard_normal((24, shapes.hidden)), jnp.bfloat16)
    ws = tuple(jnp.asarray(rng.standard_normal((2, shapes.hidden, n)) / 32, jnp.bfloat16)
               for n in (shapes.num_q_heads * shapes.head_dim,
                         shapes.num_kv_heads * shapes.head_dim))
    out = stacked_matmul(x, ws, jnp.int32(1), interpret=interpret)
    yield _check("stacked_matmul", out, stacked_matmul_reference(x, ws, jnp.int32(1)))


def _check(name, out, ref):
    err = rel_err(out, ref)
    return {"part": "check", "name": name, "rel_err": err, "ok": err < TOLERANCE}


def attention(rng, shapes, interpret):
    """Decode through the Triton kernel (the Mosaic one runs it there too); the prefill
    chunk through each candidate of the kernel table (pallas_kernels/choices.py)."""
    sm_scale = shapes.head_dim ** -0.5
    kernels = {impl: jax.jit(functools.partial(_attention_impl(impl), sm_scale=sm_scale,
                                               interpret=interpret))
               for impl in CANDIDATES["ragged_paged_attention"]}
    for num_seqs in shapes.decode_seqs:
        args = attention_case(rng, shapes, num_seqs=num_seqs, q_len=1, context=shapes.context)
        seconds = timed(kernels["pallas"], *args, iters=shapes.iters)
        kv_bytes = 2 * 2 * num_seqs * shapes.context * shapes.num_kv_heads * shapes.head_dim
        yield {"part": "attention", "name": f"decode_s{num_seqs}_ctx{shapes.context}",
               "op": "ragged_paged_attention", "size": num_seqs, "impl": "pallas",
               "ms": seconds * 1e3, "hbm_gbps": kv_bytes / seconds / 1e9}
    n = shapes.prefill_tokens
    args = attention_case(rng, shapes, num_seqs=1, q_len=n, context=n)
    flops = 4 * n * (n + 1) / 2 * shapes.num_q_heads * shapes.head_dim  # QK^T, PV, causal
    for impl, kernel in kernels.items():
        row = {"part": "attention", "name": f"prefill_{n}", "op": "ragged_paged_attention",
               "size": n, "impl": impl}
        try:
            seconds = timed(kernel, *args, iters=max(1, shapes.iters // 4))
        except Exception as e:  # noqa: BLE001 - a candidate that fails is reported, not fatal
            yield {**row, "error": f"{type(e).__name__}: {str(e)[:500]}"}
            continue
        yield {**row, "ms": seconds * 1e3, "tflops": flops / seconds / 1e12,
               "rel_err": rel_err(kernel(*args), kernels["pallas"](*args))}


def _attention_impl(impl):
    if impl == "pallas":
        return ragged_paged_attention
    from pallas_kernels.ragged_paged_attention.mosaic import ragged_paged_attention_mosaic
    return ragged_paged_attention_mosaic


def _grouped_matmul_impl(impl):
    if impl == "pallas":
        return grouped_matmul
    if impl == "mosaic":
        from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic
        return grouped_matmul_mosaic
    from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla
    return grouped_matmul_xla


def expert_weights(w, fmt, shapes):
    """The bf16 expert stack [1, E, D, 2F] as a format the step can hold it in."""
    if fmt == "bf16":
        return w
    if fmt == "fp8":  # Qwen's FP8 checkpoints: 128 x 128 blocks
        return quantize(w, "fp8", group_k=128, group_n=128)
    return quantize(w, "int4", group_k=shapes.int4_group)  # AWQ


def moe_matmul(rng, shapes, interpret):
    """Decode cases in every weight format (bf16, fp8, int4: GB/s over the stored bytes
    of the touched experts, the speed-up over bf16 in the same run, the error against the
    reference); the prefill case in bf16."""
    cases = [(f"decode_{t}", t, b) for t, b in zip(shapes.decode_seqs, shapes.token_buckets)]
    cases.append((f"prefill_{shapes.prefill_tokens}", shapes.prefill_tokens,
                  shapes.prefill_tokens))
    def call(impl):
        fn = _grouped_matmul_impl(impl)
        if impl != "xla":  # the Pallas kernels run interpreted off the GPU
            fn = functools.partial(fn, interpret=interpret)
        return jax.jit(lambda x, w, kw: fn(x, w, **kw))

    kernels = {impl: call(impl) for impl in CANDIDATES["grouped_matmul"]}
    reference = jax.jit(lambda x, w, kw: grouped_matmul_reference(x, w, **kw))
    for name, tokens, bucket in cases:
        (x, w_bf16), kwargs, touched = moe_case(rng, shapes, tokens, bucket)
        rows = bucket * shapes.top_k
        flops = 2 * tokens * shapes.top_k * w_bf16.shape[2] * w_bf16.shape[3]
        bf16_seconds = None
        for fmt in shapes.weight_formats if name.startswith("decode") else ("bf16",):
            w = expert_weights(w_bf16, fmt, shapes)
            stored = w.nbytes if isinstance(w, QuantizedWeight) else w.size * 2
            weight_bytes = touched * stored // shapes.num_experts
            for impl in _matmul_candidates(fmt, rows, shapes):
                row = {"part": "grouped_matmul", "name": f"gate_up_{name}", "op":
                       "grouped_matmul", "size": rows, "impl": impl, "format": fmt,
                       "rows": rows, "experts_touched": touched}
                try:
                    seconds = timed(kernels[impl], x, w, kwargs, iters=shapes.iters)
                except Exception as e:  # noqa: BLE001 - reported, the others go on
                    yield {**row, "error": f"{type(e).__name__}: {str(e)[:500]}"}
                    continue
                row.update(ms=seconds * 1e3, weight_gbps=weight_bytes / seconds / 1e9,
                           tflops=flops / seconds / 1e12)
                if impl == "pallas" and fmt == "bf16":
                    bf16_seconds = seconds
                elif impl == "pallas":
                    row.update(vs_bf16=bf16_seconds / seconds)
                row.update(rel_err=rel_err(kernels[impl](x, w, kwargs), reference(x, w, kwargs)))
                yield row


def _matmul_candidates(fmt, rows, shapes):
    """Triton for every format; Mosaic GPU and XLA's ragged_dot for bf16 weights only
    (they read no quantised operands), Mosaic at prefill sizes (it runs the Triton kernel
    below them) and ragged_dot up to `ragged_dot_max_rows` (XLA computes every group
    densely: seconds per call at 16k rows)."""
    if fmt != "bf16":
        return ["pallas"]
    return ["pallas", *(["mosaic"] if rows >= 512 else []),
            *(["xla"] if rows <= shapes.ragged_dot_max_rows else [])]


def dense_matmul(rng, shapes, interpret):
    d, n, k, h = shapes.hidden, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim
    qkv = tuple(jnp.asarray(rng.standard_normal((1, d, c)) / 32, jnp.bfloat16)
                for c in (n * h, k * h, k * h))
    o = (jnp.asarray(rng.standard_normal((1, n * h, d)) / 32, jnp.bfloat16),)
    fn = jax.jit(lambda x, ws: stacked_matmul(x, ws, jnp.int32(0), interpret=interpret))
    for tokens in (shapes.token_buckets[0], shapes.prefill_tokens):
        for name, ws in (("qkv", qkv), ("o_proj", o)):
            x = jnp.asarray(rng.standard_normal((tokens, ws[0].shape[1])), jnp.bfloat16)
            seconds = timed(fn, x, ws, iters=shapes.iters)
            weight_bytes = sum(w.size for w in ws) * 2
            yield {"part": "stacked_matmul", "name": f"{name}_{tokens}", "ms": seconds * 1e3,
                   "weight_gbps": weight_bytes / seconds / 1e9,
                   "tflops": 2 * tokens * weight_bytes / 2 / seconds / 1e12}


def kv_write(rng, shapes, interpret):
    del interpret
    num_seqs = shapes.decode_seqs[-1]
    args = attention_case(rng, shapes, num_seqs=num_seqs, q_len=1, context=shapes.context)
    k_pages, v_pages, table = args[1], args[2], args[4]
    new = jnp.asarray(rng.standard_normal((num_seqs, shapes.num_kv_heads, shapes.head_dim)),
                      jnp.bfloat16)
    slots = table[:, -1] * shapes.page_size + shapes.page_size - 1
    write = jax.jit(write_kv_pages, donate_argnums=(0, 1))
    k_pages, v_pages = jax.block_until_ready(write(k_pages, v_pages, new, new, slots))
    start = time.perf_counter()
    for _ in range(shapes.iters):
        k_pages, v_pages = write(k_pages, v_pages, new, new, slots)
    jax.block_until_ready(k_pages)
    seconds = (time.perf_counter() - start) / shapes.iters
    yield {"part": "kv_write", "name": f"decode_{num_seqs}", "ms": seconds * 1e3,
           "hbm_gbps": 2 * 2 * 2 * new.size / seconds / 1e9}


PARTS = {"check": checks, "attention": attention, "grouped_matmul": moe_matmul,
         "stacked_matmul": dense_matmul, "kv_write": kv_write}


def run(parts, *, small, emit):
    """Measure `parts` in order, calling emit(row) for each result as it comes."""
    on_gpu = jax.default_backend() == "gpu"
    shapes = SMALL if small or not on_gpu else Shapes()
    rng = np.random.default_rng(0)
    for part in parts:
        try:
            for row in PARTS[part](rng, shapes, not on_gpu):
                emit(row)
        except Exception as e:  # noqa: BLE001 - report and go on: the parts are independent
            emit({"part": part, "error": f"{type(e).__name__}: {str(e)[:2000]}"})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny shapes (default off GPU)")
    parser.add_argument("--out", help="also append the JSON lines here")
    parser.add_argument("--parts", default=",".join(PARTS))
    args = parser.parse_args(argv)
    out = open(args.out, "a") if args.out else None

    def emit(row):
        line = json.dumps(row)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    emit({"part": "env", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "interpret": jax.default_backend() != "gpu"})
    run(args.parts.split(","), small=args.small, emit=emit)


if __name__ == "__main__":
    sys.exit(main())
