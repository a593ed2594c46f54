"""`LLM`: the offline library facade, shaped like vLLM's."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from serving.config import CacheConfig, EngineConfig, SchedulerConfig
from serving.engine import LLMEngine
from serving.request import RequestOutput, SamplingParams

_CACHE_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}
_SCHED_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)} - {"cache", "scheduler"}
_ALIASES = {"kv_cache_fraction": "gpu_memory_utilization"}


def engine_config_from_kwargs(model=None, **kwargs) -> EngineConfig:
    """vLLM-style flat keyword arguments -> EngineConfig (unknown names are an error)."""
    groups = {"cache": {}, "scheduler": {}, "engine": {}}
    for name, value in kwargs.items():
        name = _ALIASES.get(name, name)
        if value is None and name not in ("num_gpu_blocks_override", "max_waiting"):
            continue
        if name in _CACHE_FIELDS:
            groups["cache"][name] = value
        elif name in _SCHED_FIELDS:
            groups["scheduler"][name] = value
        elif name in _ENGINE_FIELDS:
            groups["engine"][name] = value
        else:
            raise TypeError(f"unknown engine argument {name!r}")
    return EngineConfig(model=model, cache=CacheConfig(**groups["cache"]),
                        scheduler=SchedulerConfig(**groups["scheduler"]), **groups["engine"])


class LLM:
    """Offline generation. `LLM()` serves the tiny model embedded in the package."""

    def __init__(self, model: str | None = None, **kwargs):
        self.llm_engine = LLMEngine(engine_config_from_kwargs(model, **kwargs))
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence | None = None, *,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, token dict, or list of them. Returns outputs in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else \
            [sampling_params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                self.llm_engine.add_request(rid, prompt, p,
                                            priority=priority[i] if priority else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.llm_engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, *, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of conversations."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model directory has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(chat_template_kwargs or {}))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stats(self) -> dict:
        return self.llm_engine.stats()
