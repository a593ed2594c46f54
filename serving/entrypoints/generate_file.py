"""`qwen-jax generate`: offline generation over a JSONL file; resumable, crash-safe, incremental.

Input lines: {"id": ..., "prompt": text | [token ids]} or {"id": ..., "messages": [...]},
plus optional SamplingParams fields, `chat_template_kwargs`, `metadata` (echoed back) and
`lora` (an adapter: serving/entrypoints/line_adapters.py).
Every result is one line written with a single `os.write` on an O_APPEND descriptor and
fsync'd, so a kill at any moment leaves whole lines plus at most one torn tail, which the
next run truncates before it collects the ids already done.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from serving.core.lora_request import LoRARequest
from serving.core.request import SAMPLING_FIELDS, RequestOutput, SamplingParams
from serving.entrypoints.line_adapters import LineAdapters
from serving.entrypoints.llm import LLM

# A file's records get their final outputs only, so output_kind is not one of its fields.
LINE_SAMPLING_FIELDS = frozenset(SAMPLING_FIELDS) - {"output_kind"}
OTHER_FIELDS = frozenset({"id", "prompt", "messages", "chat_template_kwargs", "metadata",
                          "lora"})


class JsonlAppender:
    """Append-only JSONL file where every record is durable once `write` returns."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd: int | None = None

    def recover(self) -> list[dict]:
        """Truncates a torn last line (no newline) and returns the complete records."""
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.truncate(self.path, end)
        records = []
        for raw in data[:end].splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # cannot come from `write`; such a line is simply not counted as done
            if isinstance(record, dict):
                records.append(record)
        return records

    def write(self, record: dict) -> None:
        if self._fd is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, line)
        if written != len(line):  # a regular file only short-writes when the disk is full
            raise OSError(f"short write to {self.path}: {written} of {len(line)} bytes")
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclasses.dataclass
class InputLine:
    line_no: int
    id: str | int  # as written in the input; `key` is what identifies it
    prompt: dict  # {"prompt": text} or {"prompt_token_ids": [...]} for the engine
    sampling_params: SamplingParams
    metadata: object = None
    lora_request: LoRARequest | None = None

    @property
    def key(self) -> str:
        return str(self.id)


class BadLine(ValueError):
    def __init__(self, reason: str, item_id=None):
        super().__init__(reason)
        self.item_id = item_id


def _derived_seed(base_seed: int, item_id: str) -> int:
    # Stable per id, so a resumed run samples exactly what the killed one would have.
    return zlib.crc32(f"{base_seed}:{item_id}".encode())


def parse_line(raw: str, line_no: int, tokenizer, default_sampling: dict,
               base_seed: int | None, adapters: LineAdapters | None = None) -> InputLine:
    """One input line -> InputLine; raises BadLine with the reason."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise BadLine(f"invalid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise BadLine(f"a line must be a JSON object, got {type(obj).__name__}")
    item_id = obj.get("id")
    if not isinstance(item_id, (str, int)) or isinstance(item_id, bool) or item_id == "":
        raise BadLine(f"missing or invalid 'id' (a non-empty string or int), got {item_id!r}")
    try:
        item = _parse_fields(obj, line_no, tokenizer, default_sampling, base_seed)
        item.lora_request = (adapters or LineAdapters()).resolve(obj.get("lora"))
        return item
    except ValueError as e:
        raise BadLine(str(e), item_id) from None


def _parse_fields(obj: dict, line_no: int, tokenizer, default_sampling: dict,
                  base_seed: int | None) -> InputLine:
    unknown = sorted(set(obj) - OTHER_FIELDS - LINE_SAMPLING_FIELDS)
    if unknown:
        raise BadLine(f"unknown field(s) {unknown}; allowed: id, prompt, messages, "
                      "chat_template_kwargs, metadata, lora and SamplingParams fields but "
                      "output_kind (a record gets its final output)")
    prompt = _engine_prompt(obj, tokenizer)
    fields = {**default_sampling, **{k: v for k, v in obj.items() if k in LINE_SAMPLING_FIELDS}}
    if fields.get("seed") is None and base_seed is not None:
        fields["seed"] = _derived_seed(base_seed, str(obj["id"]))
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise BadLine(f"invalid sampling parameters: {e}") from None
    return InputLine(line_no, obj["id"], prompt, params, obj.get("metadata"))


def _engine_prompt(obj: dict, tokenizer) -> dict:
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        raise BadLine("a line needs exactly one of 'prompt' and 'messages'")
    if has_prompt:
        prompt = obj["prompt"]
        if isinstance(prompt, str) and prompt:
            return {"prompt": prompt}
        if isinstance(prompt, list) and prompt:
            return {"prompt_token_ids": prompt}
        raise BadLine("'prompt' must be a non-empty string or list of token ids")
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages or \
            not all(isinstance(m, dict) for m in messages):
        raise BadLine("'messages' must be a non-empty list of {role, content} objects")
    if tokenizer is None:
        raise BadLine("'messages' needs a tokenizer; the model has none")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **(obj.get("chat_template_kwargs") or {}))
    except Exception as e:  # template errors are the line's fault, not the run's
        raise BadLine(f"chat template failed: {type(e).__name__}: {e}") from None
    return {"prompt_token_ids": list(ids)}


def result_record(item: InputLine, output: RequestOutput, finished_at: float) -> dict:
    first = output.outputs[0]
    num_completion = sum(len(o.token_ids) for o in output.outputs)
    metrics = output.metrics
    ttft = e2e = None
    if metrics is not None:
        if metrics.first_token_time is not None:
            ttft = round(metrics.first_token_time - metrics.arrival_time, 6)
        e2e = round((metrics.finished_time or finished_at) - metrics.arrival_time, 6)
    record: dict[str, Any] = {"id": item.id, "text": first.text, "token_ids": list(first.token_ids),
                              "finish_reason": first.finish_reason,
                              "usage": {"prompt_tokens": len(output.prompt_token_ids),
                                        "completion_tokens": num_completion,
                                        "total_tokens": len(output.prompt_token_ids)
                                        + num_completion},
                              "timing": {"ttft_s": ttft, "e2e_s": e2e}}
    if len(output.outputs) > 1:
        record["outputs"] = [{"index": o.index, "text": o.text, "token_ids": list(o.token_ids),
                              "finish_reason": o.finish_reason} for o in output.outputs]
    if item.metadata is not None:
        record["metadata"] = item.metadata
    return record


def _count_lines(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


class _FileRun:
    """State of one pass over the input: what is done, in flight, and reported."""

    def __init__(self, engine, input_path: Path, output: JsonlAppender, errors: JsonlAppender,
                 default_sampling: dict, base_seed: int | None, adapters: LineAdapters):
        self.engine, self.input_path, self.adapters = engine, input_path, adapters
        self.output, self.errors = output, errors
        self.default_sampling, self.base_seed = default_sampling, base_seed
        self.done = {str(r["id"]) for r in output.recover() if "id" in r}
        self.reported_lines = {r.get("line") for r in errors.recover()}
        self.seen: set[str] = set()
        self.pending: dict[str, InputLine] = {}
        self.counts = {"num_lines": 0, "completed": 0, "skipped": 0, "errors": 0,
                       "prompt_tokens": 0, "completion_tokens": 0}

    def items(self, bar) -> Iterator[InputLine]:
        """Valid, not-yet-done items in file order; bad lines are reported on the way."""
        with open(self.input_path, encoding="utf-8", errors="replace") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                self.counts["num_lines"] += 1
                try:
                    item = parse_line(raw, line_no, self.engine.tokenizer,
                                      self.default_sampling, self.base_seed, self.adapters)
                    if item.key in self.seen:
                        raise BadLine(f"duplicate id {item.id!r}", item.id)
                except BadLine as e:
                    self.report(line_no, e.item_id, str(e), bar)
                    continue
                self.seen.add(item.key)
                if item.key in self.done:
                    self.counts["skipped"] += 1
                    bar.update(1)
                    continue
                yield item

    def report(self, line_no: int, item_id, reason: str, bar) -> None:
        self.counts["errors"] += 1
        bar.update(1)
        if line_no not in self.reported_lines:  # a resumed run does not report it twice
            self.errors.write({"line": line_no, "id": item_id, "error": reason})

    def submit(self, item: InputLine, bar) -> None:
        try:
            self.engine.add_request(item.key, item.prompt, item.sampling_params, stream=False,
                                    lora_request=item.lora_request)
        except ValueError as e:  # too long a prompt, token ids outside the vocabulary, ...
            self.report(item.line_no, item.id, str(e), bar)
            return
        self.pending[item.key] = item

    def finish(self, output: RequestOutput, bar) -> None:
        item = self.pending.pop(output.request_id)
        if output.error is not None:  # the engine failed this line alone; a rerun retries it
            self.report(item.line_no, item.id, output.error, bar)
            return
        record = result_record(item, output, time.monotonic())
        self.output.write(record)
        self.counts["completed"] += 1
        self.counts["prompt_tokens"] += record["usage"]["prompt_tokens"]
        self.counts["completion_tokens"] += record["usage"]["completion_tokens"]
        bar.update(1)

    def run(self, max_in_flight: int, bar) -> None:
        started = time.perf_counter()
        items = self.items(bar)
        exhausted = False
        while True:
            while not exhausted and len(self.pending) < max_in_flight:
                item = next(items, None)
                exhausted = item is None
                if item is not None:
                    self.submit(item, bar)
            if not self.pending:
                return
            for output in self.engine.step():
                if output.finished:
                    self.finish(output, bar)
            elapsed = time.perf_counter() - started
            bar.set_postfix_str(f"{self.counts['completion_tokens'] / elapsed:.1f} tok/s",
                                refresh=False)


def generate_file(input, output, *, llm=None, model: str | None = None,
                  engine_kwargs: dict | None = None, default_sampling: dict | None = None,
                  errors_path=None, progress: bool = True, base_seed: int | None = None,
                  max_in_flight: int | None = None,
                  lora_modules: Sequence[LoRARequest] = ()) -> dict:
    """Generates a result line in `output` for every valid line of `input` not already there.

    Bad lines go to `errors_path` (default `<output>.errors.jsonl`, created only when
    needed) with their line number and reason. Without a `seed` of its own, a line samples
    with one derived from `base_seed` and its id, so a resumed run reproduces the killed
    one. `lora_modules` are registered first (a bad one stops the run); a line's `lora`
    names one of them or gives its own. Returns counts, tokens and throughput of this run.
    """
    from tqdm import tqdm

    input_path, output_path = Path(input), Path(output)
    if not input_path.is_file():
        raise FileNotFoundError(f"input file {str(input_path)!r} does not exist")
    errors_path = Path(errors_path) if errors_path else Path(f"{output_path}.errors.jsonl")
    unknown = sorted(set(default_sampling or {}) - LINE_SAMPLING_FIELDS)
    if unknown:
        raise ValueError(f"default_sampling has unknown SamplingParams field(s) {unknown}")
    if llm is None:
        llm = LLM(model, **(engine_kwargs or {}))
    engine = llm.llm_engine
    for lora in lora_modules:
        engine.add_lora(lora)
    max_in_flight = max_in_flight or 2 * engine.scheduler_config.max_num_seqs
    out, errs = JsonlAppender(output_path), JsonlAppender(errors_path)
    # the model's generation-config defaults, under the caller's
    defaults = {**engine.default_sampling, **(default_sampling or {})}
    run = _FileRun(engine, input_path, out, errs, defaults, base_seed,
                   LineAdapters(lora_modules))
    started = time.perf_counter()
    try:
        with tqdm(total=_count_lines(input_path), desc="generate", unit="req",
                  disable=not progress) as bar:
            run.run(max_in_flight, bar)
    finally:
        out.close()
        errs.close()
        for key in list(run.pending):  # an exception mid-run: leave the engine clean
            engine.abort(key)
    elapsed = time.perf_counter() - started
    counts = run.counts
    return {**counts, "output": str(output_path),
            "errors_file": str(errors_path) if counts["errors"] else None,
            "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(counts["completed"] / elapsed, 3) if elapsed else 0.0,
            "output_tokens_per_s": round(counts["completion_tokens"] / elapsed, 2)
            if elapsed else 0.0}
