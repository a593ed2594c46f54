"""`LLM`: the offline library facade, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from serving.core.lora_request import LoRARequest
from serving.core.request import RequestOutput, SamplingParams
from serving.engine.config import EngineConfig, engine_config_from_kwargs
from serving.engine.llm_engine import LLMEngine


def make_engines(config: EngineConfig) -> list[LLMEngine]:
    """One engine per data-parallel replica, each on its own TP x EP devices."""
    parallel = config.parallel
    if parallel.data_parallel_size == 1:
        return [LLMEngine(config)]
    import jax
    devices = jax.devices()
    if parallel.world_size > len(devices):
        raise ValueError(f"data_parallel_size x tensor_parallel_size x expert_parallel_size = "
                         f"{parallel.world_size} exceeds the {len(devices)} devices available")
    size = parallel.replica_size
    return [LLMEngine(config, devices=devices[i * size:(i + 1) * size])
            for i in range(parallel.data_parallel_size)]


def per_prompt_loras(lora_request, num_prompts: int) -> list[LoRARequest | None]:
    """`generate`'s lora_request as one entry (an adapter or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if not isinstance(lora_request, Sequence) or isinstance(lora_request, str):
        raise ValueError(f"lora_request must be a LoRARequest, a list of them (one per "
                         f"prompt) or None, got {type(lora_request).__name__}")
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} lora_requests for {num_prompts} prompts")
    for i, lora in enumerate(loras):
        if lora is not None and not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request[{i}] must be a LoRARequest or None, got "
                             f"{type(lora).__name__}")
    return loras


class LLM:
    """Offline generation. `LLM()` serves the tiny model embedded in the package.
    With data_parallel_size > 1 each replica is an engine of its own; requests go to the
    replica with the fewest unfinished ones."""

    def __init__(self, model: str | None = None, **kwargs):
        self.engines = make_engines(engine_config_from_kwargs(model, **kwargs))
        self.llm_engine = self.engines[0]
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation-config defaults (vLLM's)."""
        return SamplingParams(**self.llm_engine.default_sampling)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence | None = None, *,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """prompts: a string, token dict, or list of them. Returns outputs in prompt order.
        `lora_request`: one adapter for every prompt, or one (or None) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else \
            [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        loras = per_prompt_loras(lora_request, len(prompts))
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._counter))
                engine = min(self.engines, key=lambda e: len(e.request_ids()))
                engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0,
                                   stream=False, lora_request=loras[i])
                ids.append(rid)
        except Exception:
            for rid in ids:
                for engine in self.engines:
                    engine.abort(rid)
            raise
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from tqdm import tqdm
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm) as bar:
            while any(e.has_unfinished_requests() for e in self.engines):
                for engine in self.engines:
                    for output in engine.step():
                        if output.finished:
                            finished[output.request_id] = output
                            bar.update(1)
        return [finished[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, *, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = False,
             tools: list[dict] | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of conversations;
        `tools` (OpenAI's function shape) are rendered by the chat template, as vLLM's;
        `lora_request` as `generate`'s."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; the model directory has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, tokenize=True, tools=tools,
            **(chat_template_kwargs or {}))} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def stats(self) -> dict:
        """Engine stats; with several replicas, counts are summed over them."""
        if len(self.engines) == 1:
            return self.llm_engine.stats()
        per = [e.stats() for e in self.engines]
        total = {k: sum(s[k] for s in per) for k, v in per[0].items()
                 if isinstance(v, (int, float)) and k != "bytes_per_page"}
        total["kv_cache_usage"] = 1 - total["num_free_pages"] / total["num_total_pages"]
        host = total["num_host_pages"]
        total["swap_space_usage"] = total["num_used_host_pages"] / host if host else 0.0
        queries = total["prefix_cache_queries"]
        total["prefix_cache_hit_rate"] = total["prefix_cache_hits"] / queries if queries else 0.0
        total["bytes_per_page"] = per[0]["bytes_per_page"]
        total["replicas"] = per
        return total
