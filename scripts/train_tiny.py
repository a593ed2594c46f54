"""Train the tiny Qwen3-MoE shipped in qwen_jax/assets/tiny-qwen3-moe (CPU, seeded).

    nice -n 10 python scripts/train_tiny.py [--out DIR] [--steps N]
    nice -n 10 python scripts/train_tiny.py --draft --steps 1500   # its draft model

Builds a byte-level BPE tokenizer with Qwen3's special tokens and chat template, trains a
small Qwen3-MoE on the generated tasks of `qwen_jax.tasks` (loss on the assistant turn
only: its think block, answer and `<|im_end|>`), and writes a normal HF checkpoint
directory. Training uses a dense causal forward over the model's own parameter pytree
(every expert computed, weighted by the router), checked against
`Qwen3ForCausalLM.__call__` before training starts. Each step holds 32 `add`, 12
`reverse`, 12 `sort` and a curriculum stage's worth of `copy` problems (COPY_STAGES);
the log shows teacher-forced exact match on held-out problems, which equals greedy
exact match.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from qwen_jax import tasks
from qwen_jax.config import ModelConfig
from qwen_jax.layers import apply_rope
from qwen_jax.model import Qwen3ForCausalLM
from qwen_jax.moe import route
from qwen_jax.tokenizer import compile_chat_template, normalize_messages

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "qwen_jax/assets/tiny-qwen3-moe"
DRAFT_OUT = DEFAULT_OUT.with_name("tiny-qwen3-draft")
MONITOR_SEED = 12_345
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Added, not special (as in Qwen3, in Qwen3's id order).
ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
         "</think>")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3's own chat template (tools, tool-call turns and tool results included), verbatim.
CHAT_TEMPLATE = (Path(__file__).with_name("qwen3_chat_template.jinja")).read_text()


# ---- tokenizer ---------------------------------------------------------------------------
def train_tokenizer(vocab_size: int, seed: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(pattern=_regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    corpus = ["user\n", "assistant\n", "system\n", "\n\n"] * 500
    for task in tasks.ALL_TASKS:
        for p in tasks.problems(task, 400, seed=seed, split="train"):
            # A copy code is random capitals: merges learnt from it would split each code
            # into rare capital pairs, so codes stay out and tokenize one letter per token.
            if task == "copy":
                corpus.append(p.prompt.replace(p.answer, ""))
            elif task == "tool":  # the tools header too, without its capital runs (XML)
                corpus += [re.sub(r"[A-Z]{2,}", "", render_prompt(messages, tools) + done)
                           for messages, tools, done in p.turns()]
            else:
                corpus += [p.prompt, p.answer]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(list(SPECIAL))
    tok.add_tokens(list(ADDED))
    return tok


def _regex(pattern: str):
    from tokenizers import Regex
    return Regex(pattern)


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {
        "content": t, "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": t in SPECIAL} for t in SPECIAL + ADDED}
    config = {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 1024,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


@functools.cache
def _compiled_template():
    # The serving renderer: `tojson` as transformers writes it (jinja's own sorts keys).
    return compile_chat_template(CHAT_TEMPLATE)


def render_prompt(messages: list[dict], tools=()) -> str:
    return _compiled_template().render(messages=normalize_messages(messages),
                                       tools=list(tools) or None, add_generation_prompt=True)


# ---- data --------------------------------------------------------------------------------
def encode_problem(tok: Tokenizer, p) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids + <|im_end|>) per assistant turn, tokenized separately,
    as at inference.

    A prompt ends at `<|im_start|>assistant\n` (thinking mode, the template's default);
    the completion is the think block then the answer. For a problem without reasoning the
    whole sequence equals the `enable_thinking=False` prompt followed by the answer, so
    the model serves both modes."""
    im_end = tok.token_to_id("<|im_end|>")
    return [(tok.encode(render_prompt(messages, tools)).ids, tok.encode(done).ids + [im_end])
            for messages, tools, done in p.turns()]


def make_batch(tok, rng, makers: list, seq_len: int, pad_id: int, answer_len: int = 32):
    """makers: problem makers, one row per assistant turn -> (ids int32[B, T], non-pad
    f32[B, T], answer positions int32[B, A], their next tokens int32[B, A], answer mask
    f32[B, A]). Position i predicts token i + 1."""
    rows = [row for make in makers for row in encode_problem(tok, make(rng))]
    ids = np.full((len(rows), seq_len), pad_id, np.int32)
    pos = np.zeros((len(rows), answer_len), np.int32)
    targets = np.zeros((len(rows), answer_len), np.int32)
    mask = np.zeros((len(rows), answer_len), np.float32)
    for i, (prompt, answer) in enumerate(rows):
        seq = prompt + answer
        if len(seq) > seq_len or len(answer) > answer_len:
            raise ValueError(f"example of {len(seq)} tokens exceeds seq_len={seq_len}")
        ids[i, :len(seq)] = seq
        n = len(answer)
        pos[i, :n] = np.arange(len(prompt) - 1, len(seq) - 1)
        targets[i, :n], mask[i, :n] = answer, 1.0
    return ids, (ids != pad_id).astype(np.float32), pos, targets, mask


# Copy curriculum: (max filler words, padded length, problems per step). Training starts
# on short contexts, where the copy circuit forms quickly, and moves to the next stage once
# the model copies 90% of held-out problems of the current one; the last is the eval's
# 150-300 words. Rows per step shrink as contexts grow.
COPY_STAGES = ((16, 64, 32), (40, 128, 24), (100, 192, 12), (180, 256, 8), (300, 352, 6))
COPY_ADVANCE = 0.9
COPY_CHECK_EVERY = 50
TOOL_LEN, TOOL_ANSWER_LEN = 256, 40  # a tool turn: <= 237 tokens, answers <= 33


def monitor_batch(tok, rng, task: str, pad_id: int):
    """Held-out problems of one task for the progress log (64 tool problems: 128 rows)."""
    if task == "tool":
        return make_batch(tok, rng, [tasks.MAKERS[task]] * 64, TOOL_LEN, pad_id,
                          TOOL_ANSWER_LEN)
    return make_batch(tok, rng, [tasks.MAKERS[task]] * 128, 352 if task == "copy" else 48,
                      pad_id)


def copy_maker(stage: int):
    max_words = COPY_STAGES[stage][0]
    return functools.partial(tasks.make_copy, min_words=max_words // 2, max_words=max_words)


# ---- model -------------------------------------------------------------------------------
def draft_config(vocab_size: int, im_end: int, eot: int) -> ModelConfig:
    """The tiny model's draft (speculative decoding's method draft_model): two dense
    layers of half the width, the same vocabulary. Two KV heads: with one, XLA on CPU
    lays the cache's size-1 head axis out apart and copies the whole cache around each
    write (a 2-layer draft's proposal took 40 ms instead of 2)."""
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0,
        max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(0, 1),
        bos_token_id=eot, eos_token_id=im_end)


def tiny_config(vocab_size: int, im_end: int, eot: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=10_000.0,
        max_position_embeddings=1024, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=(2,),
        bos_token_id=eot, eos_token_id=im_end)


def dense_attention(attn, x, rope):
    """x: [B, T, D] -> [B, T, D]; causal, GQA (query head n reads kv head n // G)."""
    b, t, _ = x.shape
    n, k, h = attn.num_heads, attn.num_kv_heads, attn.head_dim
    positions = jnp.arange(t, dtype=jnp.int32)
    q = apply_rope(attn.q_norm(attn.q_proj(x).reshape(b, t, n, h)), positions, *rope)
    kk = apply_rope(attn.k_norm(attn.k_proj(x).reshape(b, t, k, h)), positions, *rope)
    v = attn.v_proj(x).reshape(b, t, k, h)  # [B, T, K, H]
    q = q.reshape(b, t, k, n // k, h)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, kk).astype(jnp.float32) * h ** -0.5
    causal = jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1).astype(x.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n * h)
    return attn.o_proj(out)


def dense_moe(moe, x, mask):
    """x: [B, T, D] -> ([B, T, D], load-balancing loss); every expert computed densely."""
    b, t, d = x.shape
    x2 = x.reshape(b * t, d)  # [T', D]
    gate = moe.gate[...]
    weights, ids = route(x2, gate, moe.top_k, moe.norm_topk_prob)  # [T', k]
    num_experts = gate.shape[-1]
    dense_w = jnp.sum(jax.nn.one_hot(ids, num_experts) * weights[..., None], axis=1)  # [T', E]
    gate_up = moe.gate_up_proj[...]  # [E, D, 2, F]
    hid = jnp.einsum("td,edcf->tecf", x2, gate_up)  # [T', E, 2, F]
    act = jax.nn.silu(hid[:, :, 0]) * hid[:, :, 1]  # [T', E, F]
    y = jnp.einsum("tef,efd->ted", act, moe.down_proj[...])  # [T', E, D]
    out = jnp.einsum("ted,te->td", y, dense_w.astype(x.dtype)).reshape(b, t, d)
    m = mask.reshape(-1, 1)
    probs = jax.nn.softmax(jnp.einsum("td,de->te", x2.astype(jnp.float32), gate), axis=-1)
    chosen = jnp.sum(jax.nn.one_hot(ids, num_experts), axis=1) / moe.top_k  # [T', E]
    frac = jnp.sum(chosen * m, 0) / jnp.maximum(jnp.sum(m), 1.0)
    mean_prob = jnp.sum(probs * m, 0) / jnp.maximum(jnp.sum(m), 1.0)
    return out, num_experts * jnp.sum(frac * mean_prob)


def dense_hidden(model: Qwen3ForCausalLM, input_ids, token_mask):
    """input_ids: int32[B, T] -> (final normed hidden [B, T, D], mean load-balancing loss)."""
    cfg = model.config
    x = model.embed_tokens[...][input_ids]  # [B, T, D]
    rope = (model.rope_inv_freq[...], model.rope_scale)
    aux_total = 0.0
    for stack, (kind, _, _) in zip(model.segments, cfg.segments):
        graphdef, state = nnx.split(stack)

        def body(h, layer_state, graphdef=graphdef, kind=kind):
            layer = nnx.merge(graphdef, layer_state)
            h = h + dense_attention(layer.self_attn, layer.input_layernorm(h), rope)
            normed = layer.post_attention_layernorm(h)
            if kind == "moe":
                out, aux = dense_moe(layer.mlp, normed, token_mask)
            else:
                out, aux = layer.mlp(normed, None, None), jnp.zeros(())
            return h + out, aux

        x, aux = jax.lax.scan(body, x, state)
        aux_total = aux_total + jnp.sum(aux)
    num_moe = max(1, sum(k == "moe" for k in cfg.layer_kinds))
    return model.norm(x), aux_total / num_moe


def dense_forward(model: Qwen3ForCausalLM, input_ids, token_mask):
    """input_ids: int32[B, T] -> (float32 logits [B, T, V], mean load-balancing loss)."""
    hidden, aux = dense_hidden(model, input_ids, token_mask)
    return model.compute_logits(hidden), aux


def loss_fn(params, graphdef, rest, batch, aux_weight):
    """Cross-entropy on assistant tokens only (logits computed only there) + balance loss."""
    ids, token_mask, pos, targets, mask = batch
    model = nnx.merge(graphdef, params, rest)
    hidden, aux = dense_hidden(model, ids, token_mask)  # [B, T, D]
    hidden = jnp.take_along_axis(hidden, pos[..., None], axis=1)  # [B, A, D]
    nll = optax.softmax_cross_entropy_with_integer_labels(model.compute_logits(hidden), targets)
    ce = jnp.sum(nll * mask) / jnp.sum(mask)
    return ce + aux_weight * aux, (ce, aux)


def make_train_step(graphdef, rest, optimizer, aux_weight):
    @jax.jit
    def step(params, opt_state, batches):
        def total(p):
            losses = [loss_fn(p, graphdef, rest, b, aux_weight) for b in batches]
            return sum(l for l, _ in losses), ([m[0] for _, m in losses],
                                               sum(m[1] for _, m in losses))
        (_, metrics), grads = jax.value_and_grad(total, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics
    return step


def make_exact_match(graphdef, rest):
    """Teacher-forced exact match: every completion token is the argmax given the ones
    before it, which is exactly when greedy decoding reproduces the completion."""
    @jax.jit
    def exact(params, batch):
        ids, token_mask, pos, targets, mask = batch
        model = nnx.merge(graphdef, params, rest)
        hidden, _ = dense_hidden(model, ids, token_mask)
        hidden = jnp.take_along_axis(hidden, pos[..., None], axis=1)
        pred = jnp.argmax(model.compute_logits(hidden), axis=-1)
        return jnp.mean(jnp.all((pred == targets) | (mask == 0), axis=1))
    return exact


def check_dense_forward(model: Qwen3ForCausalLM, vocab: int) -> float:
    ids = jax.random.randint(jax.random.key(1), (2, 40), 0, vocab, jnp.int32)
    with jax.default_matmul_precision("highest"):
        ref = model(ids)
        ours, _ = dense_forward(model, ids, jnp.ones(ids.shape))
    err = float(jnp.max(jnp.abs(ref - ours)))
    scale = max(1.0, float(jnp.max(jnp.abs(ref))))  # trained logits are tens, not ones
    if err > 1e-5 * scale:
        raise RuntimeError(f"dense training forward differs from model(): max |diff| = {err} "
                           f"(max |logit| {scale:.1f})")
    return err


# ---- HF export ---------------------------------------------------------------------------
def hf_tensors(model: Qwen3ForCausalLM) -> dict[str, np.ndarray]:
    """Our params -> HF Qwen3-MoE names (torch [out, in]; experts stored per expert)."""
    cfg = model.config
    out = {"model.embed_tokens.weight": model.embed_tokens[...],
           "model.norm.weight": model.norm.weight[...], "lm_head.weight": model.lm_head[...].T}
    for stack, (kind, first, count) in zip(model.segments, cfg.segments):
        for j in range(count):
            p = f"model.layers.{first + j}."
            out[p + "input_layernorm.weight"] = stack.input_layernorm.weight[j]
            out[p + "post_attention_layernorm.weight"] = stack.post_attention_layernorm.weight[j]
            attn = stack.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[p + f"self_attn.{name}.weight"] = getattr(attn, name).kernel[j].T
            out[p + "self_attn.q_norm.weight"] = attn.q_norm.weight[j]
            out[p + "self_attn.k_norm.weight"] = attn.k_norm.weight[j]
            mlp = stack.mlp
            if kind == "dense":
                for name in ("gate_proj", "up_proj", "down_proj"):
                    out[p + f"mlp.{name}.weight"] = getattr(mlp, name).kernel[j].T
                continue
            out[p + "mlp.gate.weight"] = mlp.gate[j].T  # [E, D]
            for e in range(cfg.num_experts):
                gate_up = mlp.gate_up_proj[j, e]  # [D, 2, F]
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[:, 0].T
                out[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[:, 1].T
                out[p + f"mlp.experts.{e}.down_proj.weight"] = mlp.down_proj[j, e].T
    return {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in out.items()}


def save_checkpoint(model: Qwen3ForCausalLM, tok: Tokenizer, out: Path) -> None:
    from safetensors.numpy import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf_tensors(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**model.config.to_hf_dict(), "torch_dtype": "float32", "use_cache": True}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    gen = {"bos_token_id": eot, "eos_token_id": [im_end, eot], "pad_token_id": eot,
           "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer(tok, out)


def initial_model(init: Path | None, cfg: ModelConfig, seed: int) -> Qwen3ForCausalLM:
    """Random weights from `seed`, or the weights of the checkpoint `init`."""
    if init is None:
        return Qwen3ForCausalLM(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed), impl="reference")
    from qwen_jax.weights import load_model
    model = load_model(str(init), dtype="float32", impl="reference")
    if model.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"--init {init} has vocab_size {model.config.vocab_size}, its "
                         f"tokenizer needs {cfg.vocab_size}")
    return model


# ---- main --------------------------------------------------------------------------------
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-add", type=int, default=32, help="add problems per step")
    ap.add_argument("--num-reverse", type=int, default=12)
    ap.add_argument("--num-sort", type=int, default=12)
    ap.add_argument("--num-tool", type=int, default=4,
                    help="tool problems per step (two rows each: the call, the answer)")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--save-every", type=int, default=0,
                    help="also write the checkpoint every N steps (0: only at the end)")
    ap.add_argument("--vocab", type=int, default=1024,
                    help="tokenizer size limit (BPE stops earlier when no pair repeats)")
    ap.add_argument("--tokenizer-only", action="store_true")
    ap.add_argument("--draft", action="store_true",
                    help="train the tiny model's draft (two dense layers, draft_config) with "
                         "the shipped tiny model's tokenizer, into qwen_jax/assets/"
                         "tiny-qwen3-draft unless --out says otherwise")
    ap.add_argument("--init", type=Path, default=None,
                    help="continue training this checkpoint (its tokenizer and weights; the "
                         "copy task at full length) instead of starting from scratch")
    args = ap.parse_args(argv)
    if args.draft and args.out == DEFAULT_OUT:
        args.out = DRAFT_OUT
    jax.config.update("jax_default_matmul_precision", "highest")
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer_dir = args.init or (DEFAULT_OUT if args.draft else None)
    tok = (Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")) if tokenizer_dir
           else train_tokenizer(args.vocab - len(SPECIAL) - len(ADDED), args.seed))
    save_tokenizer(tok, args.out)
    if args.tokenizer_only:
        return
    pad_id = tok.token_to_id("<|endoftext|>")
    vocab = -(-tok.get_vocab_size() // 64) * 64
    config_fn = draft_config if args.draft else tiny_config
    model = initial_model(args.init, config_fn(vocab, tok.token_to_id("<|im_end|>"), pad_id),
                          args.seed)
    print(f"dense forward check: max |diff| = {check_dense_forward(model, vocab):.2e}")
    jax.config.update("jax_default_matmul_precision", "default")

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, min(100, args.steps // 4), args.steps, args.lr * 0.05)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(schedule, b2=0.98, weight_decay=0.01))
    opt_state = optimizer.init(params)
    step_fn = make_train_step(graphdef, rest, optimizer, aux_weight=0.01)
    exact_fn = make_exact_match(graphdef, rest)
    # Progress monitor: held-out problems under a seed that eval_tasks does not use.
    monitor_rng = tasks.task_rng("add", "eval", MONITOR_SEED)
    monitor = {t: monitor_batch(tok, monitor_rng, t, pad_id) for t in tasks.ALL_TASKS}
    copy_monitor = functools.cache(lambda stage: make_batch(
        tok, tasks.task_rng("copy", "eval", MONITOR_SEED + 1 + stage),
        [copy_maker(stage)] * 64, COPY_STAGES[stage][1], pad_id))
    rng = np.random.default_rng([args.seed, 7])
    stage, start = (len(COPY_STAGES) - 1 if args.init else 0), time.time()
    for step in range(args.steps):
        max_words, copy_len, num_copy = COPY_STAGES[stage]
        batches = (make_batch(tok, rng, [tasks.make_add] * args.num_add, 40, pad_id),
                   make_batch(tok, rng, [tasks.make_reverse] * args.num_reverse
                              + [tasks.make_sort] * args.num_sort, 48, pad_id),
                   make_batch(tok, rng, [copy_maker(stage)] * num_copy, copy_len, pad_id),
                   make_batch(tok, rng, [tasks.MAKERS["tool"]] * args.num_tool, TOOL_LEN,
                              pad_id, TOOL_ANSWER_LEN))
        params, opt_state, metrics = step_fn(params, opt_state, batches)
        if (stage < len(COPY_STAGES) - 1 and step % COPY_CHECK_EVERY == COPY_CHECK_EVERY - 1
                and float(exact_fn(params, copy_monitor(stage))) >= COPY_ADVANCE):
            stage += 1
            print(f"step {step:5d}  copy curriculum -> up to {COPY_STAGES[stage][0]} words",
                  flush=True)
        if step % args.log_every == 0 or step == args.steps - 1:
            ce, aux = metrics
            exact = {t: float(exact_fn(params, b)) for t, b in monitor.items()}
            print(f"step {step:5d}  ce add {ce[0]:.3f} reverse/sort {ce[1]:.3f} copy {ce[2]:.3f}"
                  f" tool {ce[3]:.3f}"
                  f" ({max_words} words)  aux {float(aux):.3f}  teacher-forced exact "
                  + " ".join(f"{t} {v:.3f}" for t, v in exact.items())
                  + f"  {time.time() - start:5.0f}s", flush=True)
        if args.save_every and step and step % args.save_every == 0:
            save_checkpoint(nnx.merge(graphdef, params, rest), tok, args.out)
    model = nnx.merge(graphdef, params, rest)
    save_checkpoint(model, tok, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
