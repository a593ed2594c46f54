"""qwen-jax: serve Qwen3 / Qwen3-MoE with JAX on NVIDIA GPUs.

The package's public names, resolved on first use: the model's from this package, the
engine's from `serving`. Nothing is imported eagerly, so `import qwen_jax.config` stays
free of jax and of the engine, and no module of this package imports `serving` (the
engine sits above the model; tests/unit/test_layers.py holds both rules).
"""

import importlib

_PUBLIC = {
    "ModelConfig": "qwen_jax.config",
    "Qwen3ForCausalLM": "qwen_jax.model",
    "LLM": "serving.entrypoints.llm",
    "AsyncLLM": "serving.engine.async_llm",
    "MPAsyncLLM": "serving.engine.process",
    "LLMEngine": "serving.engine.llm_engine",
    "SamplingParams": "serving.core.request",
    "RequestOutputKind": "serving.core.request",
    "RequestOutput": "serving.core.request",
    "CompletionOutput": "serving.core.request",
    "EngineConfig": "serving.engine.config",
    "LoRARequest": "serving.core.lora_request",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'qwen_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
