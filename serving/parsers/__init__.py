"""Text parsers of a model's output: the Qwen3 reasoning parser (`<think>` blocks), the
Hermes tool-call parser, and the chat reply that combines them for a response or a stream.

Imports only `serving.core`.
"""
