"""`qwen-jax bench serve | throughput`: load generation and offline throughput.

Metric definitions follow vLLM's `vllm bench serve` so figures compare one to one.

`eval_tasks`: the tiny model's task accuracy (`qwen-jax eval`). On top, as `serving.cli`.
"""
