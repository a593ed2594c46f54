"""A tiny Qwen3-MoE checkpoint (mixed dense/MoE, GQA) shared by the engine tests, and its
HF transformers greedy continuations as the oracle."""

import numpy as np
import pytest
import torch

from tests.helpers.fixtures import QWEN3_TOKENIZER
from tests.helpers.hf import save_hf_model

VOCAB = 96


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for the session: identical bucket shapes compile once."""
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-moe")
    model = save_hf_model(path, moe=True, num_hidden_layers=3, mlp_only_layers=[0],
                          norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, max_position_embeddings=256, seed=1)
    return path, model


def hf_greedy(model, prompt, max_new_tokens):
    """HF `generate`, greedy, never stopping early."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, size=n).tolist() for n in lengths]


@pytest.fixture(scope="session")
def tokenizer_ckpt(tmp_path_factory):
    """A tiny random MoE with the real Qwen3 tokenizer files (vocab 151,936)."""
    import shutil
    path = tmp_path_factory.mktemp("tiny-moe-tok")
    model = save_hf_model(path, moe=True, vocab_size=151936, eos_token_id=151645,
                          bos_token_id=151643, max_position_embeddings=256, seed=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER / name, path / name)
    return path, model
