"""The on-device sampler: one jitted function from a step's logits and sampling arrays to
token ids (and logprobs), with its filters (top-k, top-p, min-p, penalties), draws, and
vocabulary-block helpers; `device_branches` holds the CPU/GPU forms.

Imports `serving.core` and `serving.structured_output` (the token mask).
"""
