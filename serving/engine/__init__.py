"""The engine: `LLMEngine` (add requests, step, abort) with its setup and config, the
output processor and detokenizer, generation-config defaults, `AsyncLLM` (the engine on a
thread) and `MPAsyncLLM` (the engine in a process of its own), and `exceptions`.

May import every layer below it. Entry points use its public modules: `llm_engine`,
`config`, `async_llm`, `process`, `exceptions`, `multihost`.
"""
