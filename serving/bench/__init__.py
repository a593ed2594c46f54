"""`qwen-jax bench serve | throughput`: load generation and offline throughput (metric
definitions follow vLLM's `vllm bench serve`, so figures compare one to one), and
`eval_tasks`, the tiny model's task accuracy (`qwen-jax eval`).

On top, beside `serving.cli`: imports the entry points and what they may import.
"""
