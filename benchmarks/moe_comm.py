"""MoE dispatch/combine communication under expert parallelism, three ways side by side.

On 8 simulated CPU devices (or real ones), one MoE layer as a jitted `jax.shard_map`:

  replicated_psum   tokens replicated (our layout: attention is tensor-parallel, its output
                    is all-reduced), every device runs its local experts over all tokens
                    (`qwen_jax.moe.moe_local`), combine = one psum over (expert, model).
  allgather_rs      tokens sharded over `expert` (data-parallel attention): all_gather the
                    tokens, local experts, psum_scatter back to the token shards.
  all_to_all        tokens sharded over `expert`: each device routes its tokens, packs the
                    (token, slot) pairs per destination shard into fixed buffers of capacity
                    local_tokens * top_k (nothing is ever dropped), all_to_all, local grouped
                    matmul, all_to_all back, weighted combine.

Every strategy is checked against a single-device `moe_local` (1e-4). Two compute modes:
`ragged` runs the real grouped matmul (`jax.lax.ragged_dot`, which on CPU computes every
local group densely, so compute dominates), `comm` swaps the grouped matmul for a copy so
the time left is routing, packing and the collectives (strategies are then checked against
each other). Times are medians over interleaved repeats (one call of each strategy per
round). Bytes are analytic, per device per layer, for ring collectives: what a GPU
interconnect would carry.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe_comm.py
    (the flag is set here when absent; the default run takes ~9 min on 2 loaded cores,
    nearly all of it `--modes ragged` at T=512; `--modes comm` takes ~1 min)
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_kernels import grouped_matmul_reference  # noqa: E402
from qwen_jax.moe import moe_local, route  # noqa: E402
from qwen_jax.sharding import make_mesh  # noqa: E402

STRATEGIES = ("replicated_psum", "allgather_rs", "all_to_all")
GATE_UP_SPEC = P("expert", None, None, "model")  # [E, D, 2, F]
DOWN_SPEC = P("expert", "model", None)  # [E, F, D]


def copy_gmm(lhs, rhs, group_sizes):
    """Stand-in for the grouped matmul with (almost) no FLOPs: lhs [M, K] -> [M, N] by
    tiling columns. Expert-independent, so strategies still agree with each other."""
    del group_sizes
    n, k = rhs.shape[-1], lhs.shape[-1]
    return jnp.tile(lhs, (1, -(-n // k)))[:, :n]


def strategy_fns(mesh, top_k: int, gmm, norm: bool = True):
    """name -> (jitted fn(x, gate, gate_up, down) -> [T, D], token PartitionSpec)."""
    tp = mesh.shape["model"]

    def replicated_psum(x, gate, gate_up, down):
        valid = jnp.ones(x.shape[:1], bool)
        w, ids = route(x, gate, top_k, norm)
        first = jax.lax.axis_index("expert") * gate_up.shape[0]
        y = moe_local(x, valid, w, ids, gate_up, down, first_expert=first, top_k=top_k, gmm=gmm)
        return jax.lax.psum(y, ("expert", "model"))

    def allgather_rs(x, gate, gate_up, down):
        xg = jax.lax.all_gather(x, "expert", axis=0, tiled=True)  # [T, D]
        valid = jnp.ones(xg.shape[:1], bool)
        w, ids = route(xg, gate, top_k, norm)
        first = jax.lax.axis_index("expert") * gate_up.shape[0]
        y = moe_local(xg, valid, w, ids, gate_up, down, first_expert=first, top_k=top_k,
                      gmm=gmm)
        y = jax.lax.psum_scatter(y, "expert", scatter_dimension=0, tiled=True)  # [T/EP, D]
        return jax.lax.psum(y, "model") if tp > 1 else y

    def all_to_all(x, gate, gate_up, down):
        ep = jax.lax.axis_size("expert")
        num_local = gate_up.shape[0]
        tl, dim = x.shape
        cap = tl * top_k  # no drops even if every pair goes to one shard
        w, ids = route(x, gate, top_k, norm)  # [Tl, k]
        dest = (ids // num_local).reshape(-1)  # [M] destination shard of each pair
        onehot = dest[:, None] == jnp.arange(ep)[None]  # [M, EP]
        pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], 1)[:, 0]
        slot = dest * cap + pos  # [M] into [EP * cap)
        send_x = jnp.zeros((ep * cap, dim), x.dtype).at[slot].set(jnp.repeat(x, top_k, 0))
        send_e = jnp.full((ep * cap,), num_local, jnp.int32).at[slot].set(
            (ids % num_local).reshape(-1))  # local expert id at the destination; sentinel
        recv_x = jax.lax.all_to_all(send_x.reshape(ep, cap, dim), "expert", 0, 0)
        recv_e = jax.lax.all_to_all(send_e.reshape(ep, cap), "expert", 0, 0).reshape(-1)
        rows = recv_x.reshape(ep * cap, dim)
        valid = recv_e < num_local
        # One (row, expert) pair per received row, weight 1: moe_local's sorted grouped
        # matmul; empty slots sort past the local groups.
        y = moe_local(rows, valid, jnp.ones((ep * cap, 1), jnp.float32), recv_e[:, None],
                      gate_up, down, first_expert=0, top_k=1, gmm=gmm)  # [EP*cap, D]
        back = jax.lax.all_to_all(y.reshape(ep, cap, dim), "expert", 0, 0)
        y_pairs = back.reshape(ep * cap, dim)[slot].reshape(tl, top_k, dim)
        y = jnp.einsum("tkd,tk->td", y_pairs, w.astype(x.dtype))
        return jax.lax.psum(y, "model") if tp > 1 else y

    out = {}
    for name, fn, tok in (("replicated_psum", replicated_psum, P()),
                          ("allgather_rs", allgather_rs, P("expert", None)),
                          ("all_to_all", all_to_all, P("expert", None))):
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(tok, P(), GATE_UP_SPEC, DOWN_SPEC),
                           out_specs=tok, check_vma=False)
        out[name] = (jax.jit(sm), tok)
    return out


def reference(x, gate, gate_up, down, top_k, gmm, norm=True):
    """Single-device MoE: every expert local."""
    dev = jax.devices()[0]
    x, gate, gate_up, down = jax.device_put((x, gate, gate_up, down), dev)
    w, ids = route(x, gate, top_k, norm)
    return moe_local(x, jnp.ones(x.shape[:1], bool), w, ids, gate_up, down, first_expert=0,
                     top_k=top_k, gmm=gmm)


def make_inputs(seed, tokens, dim, experts, ffn, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(ks[0], (tokens, dim), dtype)
    gate = jax.random.normal(ks[1], (dim, experts), dtype) / np.sqrt(dim)
    gate_up = jax.random.normal(ks[2], (experts, dim, 2, ffn), dtype) / np.sqrt(dim)
    down = jax.random.normal(ks[3], (experts, ffn, dim), dtype) / np.sqrt(ffn)
    return x, gate, gate_up, down


def comm_bytes(tokens, dim, top_k, ep, tp, itemsize):
    """Bytes each device sends per layer (ring algorithms; a ring all-reduce of n bytes over
    N devices sends 2 (N-1)/N n, all-gather / reduce-scatter (N-1)/N n each)."""
    n = ep * tp
    td = tokens * dim * itemsize
    tl = tokens // ep
    model_ar = 2 * (tp - 1) / tp * tl * dim * itemsize  # F partial sums of the local tokens
    cap = tl * top_k
    a2a_padded = (ep - 1) * cap * (dim * itemsize + 4) + (ep - 1) * cap * dim * itemsize
    a2a_ragged = 2 * (ep - 1) / ep * tl * top_k * dim * itemsize  # uniform routing
    return {
        "replicated_psum": 2 * (n - 1) / n * td,
        "allgather_rs": 2 * (ep - 1) / ep * td + model_ar,
        "all_to_all": a2a_padded + model_ar,
        "all_to_all_ragged_ideal": a2a_ragged + model_ar,
    }


def timed(fn, args):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t) * 1e3


def run_case(*, ep, tp, tokens, dim, experts, ffn, top_k, mode, repeats, seed=0):
    mesh = make_mesh(tp, ep)
    gmm = grouped_matmul_reference if mode == "ragged" else copy_gmm
    x, gate, gate_up, down = make_inputs(seed, tokens, dim, experts, ffn)
    fns = strategy_fns(mesh, top_k, gmm)
    w_args = (jax.device_put(gate, NamedSharding(mesh, P())),
              jax.device_put(gate_up, NamedSharding(mesh, GATE_UP_SPEC)),
              jax.device_put(down, NamedSharding(mesh, DOWN_SPEC)))
    args, outs = {}, {}
    for name, (fn, tok) in fns.items():
        args[name] = (jax.device_put(x, NamedSharding(mesh, tok)), *w_args)
        outs[name] = np.asarray(fn(*args[name]))  # compile + check
    if mode == "ragged":
        ref = np.asarray(reference(x, gate, gate_up, down, top_k, gmm))
    else:  # copy_gmm is exact only per F slice: check the strategies against each other
        ref = outs["replicated_psum"]
    err = {name: float(np.max(np.abs(o - ref))) for name, o in outs.items()}
    for name, e in err.items():
        assert e < 1e-4, f"{name} differs from the reference by {e}"
    times = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved, so load changes hit every strategy alike
        for name, (fn, _) in fns.items():
            times[name].append(timed(fn, args[name]))
    med = {name: statistics.median(t) for name, t in times.items()}
    by = comm_bytes(tokens, dim, top_k, ep, tp, jnp.dtype(x.dtype).itemsize)
    return {
        "ep": ep, "tp": tp, "tokens": tokens, "dim": dim, "experts": experts, "ffn": ffn,
        "top_k": top_k, "mode": mode, "repeats": repeats,
        "median_ms": {k: round(v, 3) for k, v in med.items()},
        "ratio_to_replicated_psum": {k: round(v / med["replicated_psum"], 3)
                                     for k, v in med.items()},
        "all_ms": {k: [round(t, 2) for t in v] for k, v in times.items()},
        "bytes_sent_per_device": {k: int(v) for k, v in by.items()},
        "max_abs_err": err,
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, nargs="+", default=[32, 64])
    p.add_argument("--top-k", type=int, nargs="+", default=[4, 8])
    p.add_argument("--tokens", type=int, nargs="+", default=[8, 512])
    p.add_argument("--meshes", nargs="+", default=["8x1", "4x2"], help="EPxTP")
    p.add_argument("--modes", nargs="+", default=["comm", "ragged"],
                   choices=["comm", "ragged"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cases = []
    for mode in a.modes:
        for mesh in a.meshes:
            ep, tp = map(int, mesh.split("x"))
            for experts, top_k in zip(a.experts, a.top_k):
                for tokens in a.tokens:
                    r = run_case(ep=ep, tp=tp, tokens=tokens, dim=a.dim, experts=experts,
                                 ffn=a.ffn, top_k=top_k, mode=mode, repeats=a.repeats)
                    print(f"# {mode} EP={ep} TP={tp} E={experts} k={top_k} T={tokens}: "
                          f"{r['median_ms']}", file=sys.stderr, flush=True)
                    cases.append(r)
    # The same formulas at Qwen3-235B-A22B shapes (D=4096, top-8, bf16), EP=8 on one node.
    analytic = {f"T={t}": {k: int(v) for k, v in comm_bytes(t, 4096, 8, 8, 1, 2).items()}
                for t in (8, 512, 8192)}
    report = {"backend": jax.default_backend(), "devices": jax.device_count(),
              "argv": sys.argv[1:] if argv is None else argv, "cases": cases,
              "bytes_sent_per_device_qwen3_235b_bf16_ep8": analytic}
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
