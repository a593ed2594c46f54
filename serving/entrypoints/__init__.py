"""How users reach the engine: `llm.LLM` (the offline library facade), `generate_file`
(resumable offline generation over JSONL), and `openai/` (the HTTP server).

Imports the engine's public modules, `serving.core`'s request and config types,
`serving.parsers` and `serving.metrics`; never the scheduler, the executor or the sampler.
"""
