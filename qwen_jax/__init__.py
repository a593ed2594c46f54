"""qwen-jax: serve Qwen3 / Qwen3-MoE with JAX on NVIDIA GPUs."""

from qwen_jax.config import ModelConfig
from qwen_jax.model import Qwen3ForCausalLM

__all__ = ["ModelConfig", "Qwen3ForCausalLM"]
