"""qwen-jax: serve Qwen3 / Qwen3-MoE with JAX on NVIDIA GPUs."""

from qwen_jax.config import ModelConfig
from qwen_jax.model import Qwen3ForCausalLM

# The engine lives in the `serving` package, which imports this one: resolve lazily.
_LAZY = {
    "LLM": ("serving.llm", "LLM"),
    "AsyncLLM": ("serving.async_llm", "AsyncLLM"),
    "LLMEngine": ("serving.engine", "LLMEngine"),
    "SamplingParams": ("serving.request", "SamplingParams"),
    "RequestOutput": ("serving.request", "RequestOutput"),
    "CompletionOutput": ("serving.request", "CompletionOutput"),
    "EngineConfig": ("serving.engine_config", "EngineConfig"),
}

__all__ = ["ModelConfig", "Qwen3ForCausalLM", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'qwen_jax' has no attribute {name!r}")
