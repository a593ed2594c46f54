"""Host cost of a streamed request's per-step output as its output grows, CUMULATIVE
against DELTA (`SamplingParams.output_kind`).

Per step and streamed request the engine appends the token (`OutputProcessor.append`:
detokenization, stop checks) and builds the RequestOutput. A CUMULATIVE output copies the
request's token ids, so its cost grows with the output (Qwen3's thinking replies run to
thousands of tokens); a DELTA output holds only the new token. The two kinds are timed in
turns on requests that already hold `length` output tokens, with the embedded model's
tokenizer. Prints JSON: microseconds per output (median of the repeats), the DELTA /
CUMULATIVE ratio, and what 256 such streams cost a step.

    PYTHONPATH=. python benchmarks/output_kinds.py [--lengths 100 1000 4000 16000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from qwen_jax.tokenizer import Tokenizer
from qwen_jax.weights import DEFAULT_MODEL_DIR
from serving.core.request import Request, SamplingParams
from serving.engine.detokenizer import IncrementalDetokenizer
from serving.engine.output_processor import OutputProcessor, ParentState, SeqState

TEXT = ("The engine streams every request's new tokens to its client once a step; a reply "
        "that thinks first can run to thousands of tokens before it answers. ")


def stream(tokenizer, ids: list[int], length: int, delta: bool):
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


def per_output_us(tokenizer, ids: list[int], length: int, delta: bool, steps: int) -> float:
    processor, seq, parent, build = stream(tokenizer, ids, length, delta)
    append = processor.append
    t = time.perf_counter()
    for i in range(steps):
        append(seq, ids[i % len(ids)], None, 0)
        build(parent, seq)
    return (time.perf_counter() - t) / steps * 1e6


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[100, 1000, 4000, 16000],
                   help="output tokens a request holds when it is timed")
    p.add_argument("--steps", type=int, default=300, help="outputs timed per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--streams", type=int, default=256, help="streams for the per-step figure")
    args = p.parse_args(argv)
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    ids = tokenizer.encode(TEXT * 4)
    report: dict = {"streams": args.streams, "steps": args.steps, "repeats": args.repeats,
                    "lengths": {}}
    for length in args.lengths:
        runs: dict[str, list[float]] = {"cumulative": [], "delta": []}
        for _ in range(args.repeats):  # the kinds in turns: the machine's noise hits both
            for kind in runs:
                runs[kind].append(per_output_us(tokenizer, ids, length, kind == "delta",
                                                args.steps))
        us = {kind: statistics.median(r) for kind, r in runs.items()}
        report["lengths"][length] = {
            "us_per_output": {kind: round(v, 2) for kind, v in us.items()},
            "delta_over_cumulative": round(us["delta"] / us["cumulative"], 3),
            "ms_per_step_for_streams": {kind: round(v * args.streams / 1e3, 3)
                                        for kind, v in us.items()}}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
