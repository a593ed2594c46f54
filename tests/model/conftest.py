"""Shared fixtures of the loading tests: one tiny HF checkpoint (dense + MoE segments, 2F != D
so a transposed expert tensor cannot pass) and one jitted forward reused across models."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers.hf import save_hf_model

CHECKPOINT = dict(moe=True, num_hidden_layers=3, mlp_only_layers=[1], moe_intermediate_size=12,
                  norm_topk_prob=True)
PROMPT = np.array([[3, 17, 42, 5, 88, 0, 61, 9, 23, 71, 14]], dtype=np.int32)  # [B=1, T=11]


@nnx.jit
def _forward(model, input_ids):
    return model(input_ids)


def logits(model) -> np.ndarray:
    """float32[1, T, V] logits of PROMPT; compiled once per model structure and dtype."""
    return np.asarray(_forward(model, jnp.asarray(PROMPT)))


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """(directory, HF torch model) of a float32 tiny Qwen3-MoE saved with save_pretrained."""
    directory = tmp_path_factory.mktemp("hf_tiny_moe")
    model = save_hf_model(directory, **CHECKPOINT)
    return directory, model


@pytest.fixture(scope="session")
def reference_logits(hf_checkpoint):
    """Logits of our model loaded from the single-file per-expert checkpoint."""
    from qwen_jax import Qwen3ForCausalLM
    return logits(Qwen3ForCausalLM.from_pretrained(hf_checkpoint[0], dtype="float32"))
