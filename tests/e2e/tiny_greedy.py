"""Greedy decoding references for the tiny model: our full-sequence forward and HF's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

from qwen_jax.model import Qwen3ForCausalLM
from serving.bench.eval_tasks import MAX_ANSWER_TOKENS


def eos_ids(model_path) -> set[int]:
    gen = json.loads((Path(model_path) / "generation_config.json").read_text())
    ids = gen["eos_token_id"]
    return set(ids if isinstance(ids, list) else [ids])


@dataclasses.dataclass
class _Completion:
    text: str
    token_ids: list[int]


@dataclasses.dataclass
class _Output:
    prompt: str
    outputs: list[_Completion]


class FullForwardLLM:
    """Stands in for `qwen_jax.LLM` in `evaluate`: greedy decoding that re-runs
    `Qwen3ForCausalLM.__call__` over the whole right-padded batch at every step."""

    def __init__(self, model_path, max_tokens: int = MAX_ANSWER_TOKENS, bucket: int = 64):
        self.model = Qwen3ForCausalLM.from_pretrained(model_path)
        self.tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
        self.eos = eos_ids(model_path)
        self.pad = self.tokenizer.token_to_id("<|endoftext|>")
        self.max_tokens, self.bucket = max_tokens, bucket
        graphdef, state = nnx.split(self.model)
        self._state = state
        self._forward = jax.jit(lambda st, ids: nnx.merge(graphdef, st)(ids))

    def greedy_ids(self, prompts: list[list[int]], max_tokens: int | None = None
                   ) -> list[list[int]]:
        seqs = [list(p) for p in prompts]
        lengths = [len(p) for p in prompts]
        done = [False] * len(seqs)
        for _ in range(max_tokens or self.max_tokens):
            width = -(-max(len(s) for s in seqs) // self.bucket) * self.bucket
            ids = np.full((len(seqs), width), self.pad, np.int32)
            for i, s in enumerate(seqs):
                ids[i, :len(s)] = s
            logits = self._forward(self._state, jnp.asarray(ids))  # [B, T, V]
            last = np.asarray(logits[np.arange(len(seqs)), [len(s) - 1 for s in seqs]])
            for i, token in enumerate(np.argmax(last, axis=-1).tolist()):
                if not done[i]:
                    seqs[i].append(token)
                    done[i] = token in self.eos
            if all(done):
                break
        return [_strip_eos(s[n:], self.eos) for s, n in zip(seqs, lengths)]

    def generate(self, prompts: list[str], sampling_params=None) -> list[_Output]:
        """Always greedy; max_tokens from the parameters, else the constructor's."""
        encoded = [self.tokenizer.encode(p).ids for p in prompts]
        max_tokens = getattr(sampling_params, "max_tokens", None)
        return [_Output(p, [_Completion(self.tokenizer.decode(ids), ids)])
                for p, ids in zip(prompts, self.greedy_ids(encoded, max_tokens))]


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def hf_greedy_ids(hf_model, prompts: list[list[int]], eos: set[int],
                  max_tokens: int = MAX_ANSWER_TOKENS):
    import torch
    out = []
    for prompt in prompts:
        with torch.no_grad():
            ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                                    do_sample=False, eos_token_id=sorted(eos),
                                    pad_token_id=min(eos))
        out.append(_strip_eos(ids[0, len(prompt):].tolist(), eos))
    return out
