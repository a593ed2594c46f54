"""Structured outputs on the host: llguidance grammars compiled from
`StructuredOutputsParams`, one guide (grammar state) per constrained sequence, and each
step's token bitmask of the constrained rows.

Imports only `serving.core`.
"""
