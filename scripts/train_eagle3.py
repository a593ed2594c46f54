"""Train the EAGLE-3 head of the tiny model, shipped in qwen_jax/assets/tiny-qwen3-eagle3
(CPU, seeded; speculative decoding's method eagle3 with no model path uses it).

    nice -n 10 python scripts/train_eagle3.py [--out DIR] [--steps N]

The target (the shipped tiny model) is frozen: each step runs it over the training
tasks of `qwen_jax.tasks` (as scripts/train_tiny.py builds them) for its logits and the
hidden states entering layers 1, 2 and 3, and the head learns the target's greedy token
at each answer position. Training-time test (EAGLE-3's): the head is unrolled for
--unroll steps as it drafts at serving time. Step s at position i reads the pre-norm
output of step s - 1 at i - 1 as its hidden state, and attends to step 0's keys up to
i - s plus the chain's own keys at i - s + 1 .. i; each step's loss is weighted 0.8^s.
The draft vocabulary (256 of the 896 ids; d2t maps it back) is the target tokens that
occur as answers in a sample of training batches, then the most frequent others. The
log shows, per step of the chain, how often the head's tokens equal the target's on
held-out problems (that step and all before it), and the mean acceptance length that
implies at k = --unroll.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer
from train_tiny import COPY_STAGES, TOOL_ANSWER_LEN, TOOL_LEN, copy_maker, make_batch

from qwen_jax import tasks
from qwen_jax.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
from qwen_jax.layers import rope_tables
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.weights import DEFAULT_EAGLE3_DIR, DEFAULT_MODEL_DIR

AUX_LAYERS = (1, 2, 3)  # the tiny target has 4; vLLM's default (2, 2, 1) repeats one
MONITOR_SEED = 54_321


def batches(tok, rng, pad_id, scale: int = 1):
    last = len(COPY_STAGES) - 1
    return (make_batch(tok, rng, [tasks.make_add] * 16 * scale, 40, pad_id),
            make_batch(tok, rng, [tasks.make_reverse] * 8 * scale
                       + [tasks.make_sort] * 8 * scale, 48, pad_id),
            make_batch(tok, rng, [copy_maker(2)] * 6 * scale, COPY_STAGES[2][1], pad_id),
            make_batch(tok, rng, [copy_maker(last)] * 2 * scale, COPY_STAGES[last][1], pad_id),
            make_batch(tok, rng, [tasks.MAKERS["tool"]] * 2 * scale, TOOL_LEN, pad_id,
                       TOOL_ANSWER_LEN))


def target_outputs(target, ids, pos, mask):
    """The target's greedy token per answer position (label of head position p - 1) and
    the hidden states the head reads: (labels int32[B, T], weights f32[B, T], aux)."""
    logits, aux = target.hidden_and_aux(ids)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]: the token after t
    b = jnp.arange(ids.shape[0])[:, None]
    labels = jnp.zeros_like(ids).at[b, pos - 1].set(greedy[b, pos])
    weights = jnp.zeros(ids.shape, jnp.float32).at[b, pos - 1].max(mask)
    return labels, weights, aux


def attend(head: Eagle3Head, q, keys, values, step: int):
    """q [B, T, N, H] of chain step `step`; keys/values: per step j <= step, [B, T, K, H].
    Step 0's keys up to i - step, then step j's key at i - step + j."""
    cfg = head.config
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, t = q.shape[:2]
    q = q.reshape(b, t, k, n // k, h)
    scores = [jnp.einsum("btkgh,bskh->bkgts", q, keys[0]).astype(jnp.float32)]
    causal = jnp.tril(jnp.ones((t, t), bool), -step)
    scores[0] = jnp.where(causal, scores[0], -1e30)
    shifted_v = []
    for j in range(1, step + 1):
        shift = step - j  # step j's key of the chain ending at i sits at i - shift
        kj = jnp.pad(keys[j], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t]
        shifted_v.append(jnp.pad(values[j], ((0, 0), (shift, 0), (0, 0), (0, 0)))[:, :t])
        scores.append(jnp.einsum("btkgh,btkh->bkgt", q, kj).astype(jnp.float32)[..., None])
    probs = jax.nn.softmax(jnp.concatenate(scores, -1) * h ** -0.5, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs[..., :t], values[0])
    for j, vj in enumerate(shifted_v):
        out = out + probs[..., t + j].transpose(0, 3, 1, 2)[..., None] * vj[:, :, :, None]
    return out.reshape(b, t, n * h)


def unrolled_logits(head: Eagle3Head, embed, ids, aux, num_steps: int):
    """Draft-vocabulary logits of each chain step [S, B, T, Vd] (training-time test)."""
    b, t = ids.shape
    cos, sin = rope_tables(jnp.arange(t, dtype=jnp.int32), head.rope_inv_freq[...],
                           head.rope_scale, head.dtype)
    next_ids = jnp.concatenate([ids[:, 1:], ids[:, -1:]], axis=1)  # position i: token i + 1
    embeds = embed[next_ids]
    hidden = head.fc(aux)
    keys, values, out = [], [], []
    for step in range(num_steps):
        x, residual = head.qkv(embeds, hidden)
        q, k, v = jax.vmap(head.project, in_axes=(0, None, None))(x, cos, sin)
        keys.append(k)
        values.append(v)
        normed, prenorm = head.finish(attend(head, q, keys, values, step), residual)
        out.append(jnp.einsum("btd,dv->btv", normed, head.lm_head[...],
                              preferred_element_type=jnp.float32))
        hidden = jnp.pad(prenorm, ((0, 0), (1, 0), (0, 0)))[:, :t]  # i reads i - 1's
    return jnp.stack(out)


def losses(params, graphdef, rest, target, t2d, batch, num_steps):
    """Per chain step: (weighted cross-entropy, accuracy with the chain so far right)."""
    ids, _, pos, _, mask = batch
    head = nnx.merge(graphdef, params, rest)
    labels, weights, aux = target_outputs(target, ids, pos, mask)
    draft_labels = t2d[labels]  # -1: not in the draft vocabulary
    weights = weights * (draft_labels >= 0)
    logits = unrolled_logits(head, target.embed_tokens[...], ids, aux, num_steps)
    ce, acc = [], []
    chain_ok = weights > 0  # by the chain's base b: its step s sits at b + s
    for s in range(num_steps):
        valid = weights * (jnp.arange(ids.shape[1]) >= s)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits[s],
                                                              jnp.maximum(draft_labels, 0))
        ce.append(jnp.sum(nll * valid) / jnp.maximum(jnp.sum(valid), 1.0))
        right = (jnp.argmax(logits[s], -1) == draft_labels) & (weights > 0)
        chain_ok = chain_ok & jnp.pad(right[:, s:], ((0, 0), (0, s)))
        acc.append((jnp.sum(chain_ok), jnp.sum(weights > 0)))
    return ce, acc


def draft_vocabulary(tok, pad_id, size: int = 256) -> np.ndarray:
    """The target ids that occur as answers in a sample of training batches, then the
    most frequent others (prompts included) up to `size`; sorted."""
    rng = np.random.default_rng(99)
    answers: set[int] = {tok.token_to_id("<|im_end|>")}
    counts = np.zeros(tok.get_vocab_size(), np.int64)
    for _ in range(40):
        for ids, token_mask, _, targets, mask in batches(tok, rng, pad_id):
            answers.update(int(x) for x in np.asarray(targets)[np.asarray(mask) > 0])
            np.add.at(counts, np.asarray(ids)[np.asarray(token_mask) > 0], 1)
    counts[list(answers)] = -1
    rest = [int(i) for i in np.argsort(-counts, kind="stable") if counts[i] >= 0]
    return np.array(sorted(answers | set(rest[:max(0, size - len(answers))])), np.int64)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_EAGLE3_DIR)
    ap.add_argument("--target", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unroll", type=int, default=3, help="chain steps trained (TTT)")
    ap.add_argument("--log-every", type=int, default=100)
    args = ap.parse_args(argv)
    tok = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    pad_id = tok.token_to_id("<|endoftext|>")
    target = Qwen3ForCausalLM.from_pretrained(args.target, "float32", impl="reference")
    target.aux_layers = AUX_LAYERS
    tc = target.config
    ids = draft_vocabulary(tok, pad_id)
    print(f"draft vocabulary: {len(ids)} of {tc.vocab_size} tokens", flush=True)
    cfg = Eagle3Config(
        hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size,
        intermediate_size=tc.intermediate_size, num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        vocab_size=tc.vocab_size, draft_vocab_size=len(ids), aux_layer_ids=AUX_LAYERS,
        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings)
    head = Eagle3Head(cfg, rngs=nnx.Rngs(args.seed))
    head.d2t.set_value(jnp.asarray(ids - np.arange(len(ids)), jnp.int32))
    t2d = jnp.full(tc.vocab_size, -1, jnp.int32).at[ids].set(jnp.arange(len(ids)))
    graphdef, params, rest = nnx.split(head, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, min(100, args.steps // 4),
                                                  args.steps, args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    opt_state = optimizer.init(params)
    weights = [0.8 ** s for s in range(args.unroll)]

    @jax.jit
    def train_step(params, opt_state, batch_list):
        def total(p):
            out = [losses(p, graphdef, rest, target, t2d, b, args.unroll) for b in batch_list]
            return sum(w * c for ce, _ in out for w, c in zip(weights, ce)), out
        (_, out), grads = jax.value_and_grad(total, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, out

    @jax.jit
    def evaluate(params, batch_list):
        return [losses(params, graphdef, rest, target, t2d, b, args.unroll)[1]
                for b in batch_list]

    monitor = batches(tok, np.random.default_rng(MONITOR_SEED), pad_id, scale=2)
    rng = np.random.default_rng([args.seed, 11])
    start = time.time()
    for step in range(args.steps):
        params, opt_state, out = train_step(params, opt_state, batches(tok, rng, pad_id))
        if step % args.log_every == 0 or step == args.steps - 1:
            acc = evaluate(params, monitor)
            per_step = [sum(float(a[s][0]) for a in acc) / sum(float(a[s][1]) for a in acc)
                        for s in range(args.unroll)]
            ce = [float(c) for c in out[0][0]]
            print(f"step {step:5d}  ce(add) " + " ".join(f"{c:.3f}" for c in ce)
                  + "  chain accuracy " + " ".join(f"{a:.3f}" for a in per_step)
                  + f"  acceptance length at k={args.unroll} {1 + sum(per_step):.2f}"
                  + f"  {time.time() - start:5.0f}s", flush=True)
    save_eagle3(nnx.merge(graphdef, params, rest), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
