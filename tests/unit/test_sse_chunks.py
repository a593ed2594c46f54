"""A streamed chunk of plain text is its choice's template with the text put in: the
bytes must be exactly what encoding the whole chunk gives, for any text, and chunks
that hold more (role, finish, logprobs, usage) are encoded whole."""

from __future__ import annotations

import json

import pytest

from serving.core.request import CompletionOutput, RequestMetrics, RequestOutput
from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.outputs import Job, sse
from serving.metrics.prometheus import Metrics

TEXTS = ["ab", "", ' "quoted" ', "back\\slash", "new\nline\ttab", "\x00\x1f ctl", "é 漢字 🙂",
         "qwen-jax-chunk-text-slot", "</s>\u2028\u2029"]


class _NoStats:
    def stats(self) -> dict:
        return {}


def job(kind: str, request_id: str = "req-1", model: str = "m", **body) -> Job:
    if kind == "chat":
        req = proto.parse_chat({"model": model, "messages": [{"role": "user", "content": "hi"}],
                                "stream": True, **body}, 1000)
        prompt_param, job_kind = "messages", "chatcmpl"
    else:
        req = proto.parse_completion({"model": model, "prompt": "hi", "stream": True, **body},
                                     1000)
        prompt_param, job_kind = "prompt", "cmpl"
    params = [proto.sampling_params(req, 2, 8192, prompt_param)]
    return Job(kind=job_kind, request_id=request_id, model=model, req=req, prompts=[[1, 2]],
               params=params, metrics=Metrics(_NoStats(), model))


def output(*completions: CompletionOutput, finished: bool = False) -> RequestOutput:
    return RequestOutput("x", None, [1, 2], None, list(completions), finished,
                         RequestMetrics(arrival_time=0.0))


def expected(j: Job, index: int, body: dict, finish=None) -> bytes:
    """The chunk as a whole dict through `sse`, as every chunk was encoded before."""
    choice = {"index": index, **body, "logprobs": None, "finish_reason": finish,
              "stop_reason": None}
    chunk = {"id": j.request_id, "object": "chat.completion.chunk" if j.chat else
             "text_completion", "created": j.created, "model": j.model, "choices": [choice]}
    if j.req.include_usage:
        chunk["usage"] = None
    return sse(chunk)


@pytest.mark.parametrize("options", [{}, {"stream_options": {"include_usage": True}}, {"n": 2}],
                         ids=["plain", "include_usage", "n2"])
def test_text_chunks_are_the_bytes_of_the_whole_chunk(options):
    for kind in ("chat", "completions"):
        j = job(kind, **options)
        samples = range(j.n)
        events = j.sse_chunks(0, output(*(CompletionOutput(i, "first", [5]) for i in samples)))
        for i, event in zip(samples, events):  # a chat's first chunk holds the role: whole
            delta = {"role": "assistant", "content": "first"} if j.chat else None
            assert event == expected(j, i, {"delta": delta} if j.chat else {"text": "first"})
        for text in TEXTS:
            events = j.sse_chunks(0, output(*(CompletionOutput(i, text, [5]) for i in samples)))
            for i, event in zip(samples, events):
                body = {"delta": {"content": text}} if j.chat else {"text": text}
                assert event == expected(j, i, body)
                assert json.loads(event[len(b"data: "):])["choices"][0]["index"] == i
        assert len(j._templates) == j.n  # the template path ran, once per choice


def test_chunks_that_hold_more_than_text_are_encoded_whole():
    j = job("completions", logprobs=1)
    logprobs = [{5: _Logprob(-0.5)}]
    event = j.sse_chunks(0, output(CompletionOutput(0, "ab", [5], -0.5, logprobs)))[0]
    assert json.loads(event[6:])["choices"][0]["logprobs"]["tokens"] and not j._templates
    j = job("chat")
    j.sse_chunks(0, output(CompletionOutput(0, "a", [5])))
    final = j.sse_chunks(0, output(CompletionOutput(0, "b", [5], finish_reason="length"),
                                   finished=True))[0]
    assert final == expected(j, 0, {"delta": {"content": "b"}}, finish="length")


def test_an_id_holding_the_marker_is_encoded_whole():
    j = job("completions", request_id="qwen-jax-chunk-text-slot")
    event = j.sse_chunks(0, output(CompletionOutput(0, "ab", [5])))[0]
    assert event == expected(j, 0, {"text": "ab"}) and j._templates == {0: None}


class _Logprob:
    def __init__(self, logprob: float):
        self.logprob, self.rank, self.decoded_token = logprob, 1, "x"
