"""A streamed request's output per step: a CUMULATIVE output holds the whole output, a
DELTA one only the new token; and the server makes one SSE chunk of each text output."""

from serving.core.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.output_processor import OutputProcessor, ParentState, SeqState
from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.outputs import Job
from serving.metrics.prometheus import Metrics

TEXT = "A reply that thinks first can run to thousands of tokens before it answers. "


def streamed_request(tokenizer, ids: list[int], length: int, delta: bool):
    """A streamed request that already holds `length` output tokens, and its output call."""
    prompt = ids[:8]
    params = SamplingParams(max_tokens=None, ignore_eos=True, stop=["</answer>"])
    request = Request(request_id="r", prompt_token_ids=prompt, sampling_params=params)
    request.max_num_tokens = 10**9
    seq = SeqState(request=request, parent_id="r", index=0, seed=0, blocked_ids=(),
                   detokenizer=IncrementalDetokenizer(tokenizer, prompt, stop=params.stop))
    parent = ParentState("r", None, prompt, [seq], delta=delta)
    processor = OutputProcessor(tokenizer, ())
    for i in range(length):
        processor.append(seq, ids[i % len(ids)], None, 0)
    if delta:  # what the earlier steps' outputs handed over
        processor.streamed_delta(parent, seq)
    build = processor.streamed_delta if delta else processor.streamed_output
    return processor, seq, parent, build


def test_cumulative_output_holds_the_whole_output_and_delta_the_new_token(tok):
    ids = tok.encode(TEXT * 4)
    for delta, expected in ((False, 201), (True, 1)):
        processor, seq, parent, build = streamed_request(tok, ids, 200, delta)
        processor.append(seq, ids[0], None, 0)
        (completion,) = build(parent, seq).outputs
        assert len(completion.token_ids) == expected


class _NoStats:
    def stats(self) -> dict:
        return {}


def streamed_job(kind: str) -> Job:
    if kind == "chat":
        req = proto.parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                "stream": True}, 1000)
        prompt_param, job_kind = "messages", "chatcmpl"
    else:
        req = proto.parse_completion({"model": "m", "prompt": "hi", "stream": True}, 1000)
        prompt_param, job_kind = "prompt", "cmpl"
    params = [proto.sampling_params(req, 10, 8192, prompt_param)]
    return Job(kind=job_kind, request_id="x", model="m", req=req, prompts=[[1] * 10],
               params=params, metrics=Metrics(_NoStats(), "m"))


def test_each_text_output_of_a_stream_is_one_sse_chunk():
    for kind in ("chat", "completions"):  # a chat's first chunk also holds the role
        job = streamed_job(kind)
        events = [job.sse_chunks(0, RequestOutput("x", None, [1] * 10, None,
                                                  [CompletionOutput(0, "ab", [5])], False,
                                                  RequestMetrics(arrival_time=0.0)))
                  for _ in range(4)]
        assert [len(e) for e in events] == [1, 1, 1, 1], kind
