"""What crosses between the API process and the engine process (serving/engine/process.py):
the engine's settings once (`EngineInfo`), and each RequestOutput as a tuple of what
changed (`wire_output`), rebuilt on the API side around what its stream keeps
(`decode_output`). Everything here pickles by this module's name."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from serving.core.request import CompletionOutput, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from serving.engine.async_llm import RequestStream


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    platform: str
    device_kind: str


@dataclasses.dataclass
class EngineInfo:
    """What the server reads off an engine, sent once by the engine process. The tokenizer
    and the grammar compiler (schema checks before a request is sent) are the API
    process's own, loaded from the same files."""

    config: object  # EngineConfig
    model_path: Path
    max_model_len: int
    model_config: object  # Qwen3Config
    default_sampling: dict
    page_size: int
    bucket_pairs: list
    compile_seconds: float
    load_seconds: float
    devices: list[DeviceInfo]
    cost_model: object  # CostModel
    eos_token_ids: tuple[int, ...]

    @functools.cached_property
    def tokenizer(self):
        from serving.engine.setup import load_tokenizer
        return load_tokenizer(self.config, self.model_path)

    @functools.cached_property
    def grammars(self):
        from serving.structured_output.grammar import GrammarCompiler
        if self.tokenizer is None:
            return None
        return GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                               list(self.eos_token_ids))


def wire_output(request_id, prompt, prompt_token_ids, prompt_logprobs, completions,
                finished, metrics, num_cached_tokens, error) -> tuple:
    """A RequestOutput as the engine process sends it (OutputProcessor.make_output there):
    what its request's earlier outputs did not fix, i.e. the completions (tuples of
    CompletionOutput's fields: `completion_fields` is make_completion there), the metrics'
    times, the finish and the prompt logprobs (DELTA: once). Not the prompt or its ids."""
    m = metrics
    times = None if m is None else (m.arrival_time, m.arrival_wall_time, m.first_scheduled_time,
                                    m.first_token_time, m.last_token_time, m.finished_time)
    return (request_id, completions, finished, times, num_cached_tokens, error,
            prompt_logprobs)


def decode_output(stream: RequestStream, item: tuple) -> RequestOutput:
    """`wire_output`'s tuple as the RequestOutput it was, around what the stream keeps:
    the prompt, its ids and one RequestMetrics (updated in place, as the engine's is)."""
    request_id, completions, finished, times, num_cached, error, prompt_logprobs = item
    if times is not None:
        if stream.metrics is None:
            stream.metrics = RequestMetrics(*times)
        else:
            m = stream.metrics
            (m.arrival_time, m.arrival_wall_time, m.first_scheduled_time,
             m.first_token_time, m.last_token_time, m.finished_time) = times
    return RequestOutput(request_id, stream.prompt, stream.prompt_token_ids, prompt_logprobs,
                         [CompletionOutput(*c) for c in completions], finished,
                         stream.metrics, num_cached, error)


def completion_fields(*fields) -> tuple:
    return fields


def engine_info(engine) -> EngineInfo:
    return EngineInfo(
        config=engine.config, model_path=engine.model_path, max_model_len=engine.max_model_len,
        model_config=engine.model_config, default_sampling=engine.default_sampling,
        page_size=engine.page_size, bucket_pairs=list(engine.bucket_pairs),
        compile_seconds=engine.compile_seconds, load_seconds=engine.load_seconds,
        devices=[DeviceInfo(d.platform, d.device_kind) for d in engine.devices],
        cost_model=engine.cost_model,
        eos_token_ids=tuple(sorted(engine.output_processor.eos_token_ids)))
