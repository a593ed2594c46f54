"""Sampling defaults from a checkpoint's `generation_config.json` (vLLM's
`--generation-config auto`): Qwen3 ships temperature 0.6, top_p 0.95, top_k 20, which a
request that omits those fields gets. `vllm` mode uses the neutral defaults instead."""

from __future__ import annotations

import json
from pathlib import Path

from serving.core.request import GENERATION_CONFIG_DEFAULTS

MODES = ("auto", "vllm")


def sampling_defaults(model_dir: str | Path | None, mode: str = "auto") -> dict:
    """{field: value} of the sampling fields the model's generation config sets ({} for
    `vllm`, a missing file or a model without a directory). `mode` may also be a
    directory holding the generation_config.json to use, as in vLLM."""
    if mode == "vllm":
        return {}
    folder = Path(model_dir) if mode == "auto" and model_dir is not None else Path(mode)
    if mode != "auto" and not folder.is_dir():
        raise ValueError(f"generation_config must be auto, vllm or a directory, got {mode!r}")
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    return {k: config[k] for k in GENERATION_CONFIG_DEFAULTS if config.get(k) is not None}
