"""Exact-match accuracy of a model on the held-out generated tasks, through `qwen_jax.LLM`.

    python -m serving.bench.eval_tasks [--n 500] [--model PATH] [--seed 0] [--quantization Q]
        [engine options]

Prompts use the chat template in thinking mode (its default): the model writes a think
block (empty for the list and copy tasks, the sum's digits ones-first for addition) and
then its answer; the text after `</think>` must equal the answer exactly. The tool task
scores the whole loop: the model's call is parsed (Hermes format) and run, and its answer
from the tool's result must be exact.

Prints one line per task: `TASK accuracy=0.973 n=500`. Any difference in per-problem
correctness between engine configurations (one request at a time, all at once, chunked
prefill, preemption, prefix caching) is a serving bug: greedy decoding is deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from qwen_jax import tasks
from qwen_jax.tokenizer import compile_chat_template, normalize_messages
from qwen_jax.tool_task import MAX_TOOL_TOKENS, TOOLS, ToolProblem
from qwen_jax.weights import DEFAULT_MODEL_DIR
from serving.core.request import SamplingParams
from serving.parsers.reasoning import Qwen3ReasoningParser
from serving.parsers.tool_parsers import HermesToolParser

TINY_MODEL = DEFAULT_MODEL_DIR
MAX_ANSWER_TOKENS = 32  # the think block and the answer


def chat_template(model_path: str | Path) -> str:
    with open(Path(model_path) / "tokenizer_config.json") as f:
        return json.load(f)["chat_template"]


def render_prompts(problems: Sequence[tasks.AnyProblem], template: str) -> list[str]:
    """Chat-formatted prompt strings ending at `<|im_start|>assistant\n` (thinking mode)."""
    import jinja2
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)
    return [compiled.render(messages=p.messages, add_generation_prompt=True) for p in problems]


def prompt_batch(per_task: int, seed: int = 11, model_path: str | Path = DEFAULT_MODEL_DIR):
    """Right-padded token ids [B, T] (numpy int32) of `per_task` chat prompts of each of the
    tasks, and the mask of real ones: a fixed batch for comparing logits of two models."""
    import numpy as np
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(Path(model_path) / "tokenizer.json"))
    problems = [p for t in tasks.TASKS for p in tasks.problems(t, per_task, seed=seed)]
    ids = [tokenizer.encode(t).ids for t in render_prompts(problems, chat_template(model_path))]
    batch = np.zeros((len(ids), max(map(len, ids))), np.int32)
    mask = np.zeros(batch.shape, bool)
    for i, row in enumerate(ids):
        batch[i, :len(row)], mask[i, :len(row)] = row, True
    return batch, mask


def final_answer(text: str) -> str:
    """The reply after the think block, split as the server's `--reasoning-parser qwen3`
    splits it ("" when the reply was cut off inside the think block)."""
    return (Qwen3ReasoningParser.extract(text)[1] or "").strip()


def generate_texts(llm, prompts: list[str], *, one_at_a_time: bool = False,
                   max_tokens: int = MAX_ANSWER_TOKENS) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if one_at_a_time:
        outputs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params)
    return [out.outputs[0].text for out in outputs]


def evaluate(llm, n: int, seed: int = 0, *, model_path: str | Path = TINY_MODEL,
             task_names=tasks.ALL_TASKS, one_at_a_time: bool = False
             ) -> dict[str, tuple[float, list[bool]]]:
    """Per task: (exact-match accuracy, per-problem correctness) on n held-out problems."""
    template = chat_template(model_path)
    results = {}
    for task in task_names:
        problems = tasks.problems(task, n, seed=seed, split="eval")
        if task == "tool":
            tool_problems = [p for p in problems if isinstance(p, ToolProblem)]
            correct = evaluate_tool(tool_problems, template, lambda prompts, max_tokens: (
                generate_texts(llm, prompts, one_at_a_time=one_at_a_time, max_tokens=max_tokens)))
        else:
            texts = generate_texts(llm, render_prompts(problems, template),
                                   one_at_a_time=one_at_a_time)
            correct = [final_answer(text) == p.answer for text, p in zip(texts, problems)]
        results[task] = (sum(correct) / max(1, n), correct)
    return results


def parse_call(text: str) -> dict | None:
    """The arguments of the one `add` call of a generated first turn (after its think
    block, as the server's `--reasoning-parser qwen3` splits it), parsed as the server's
    Hermes tool parser parses it; None unless there is exactly one such call."""
    content = Qwen3ReasoningParser.extract(text)[1] or ""
    parsed = HermesToolParser.extract(content, ["add"])
    if len(parsed.calls) != 1 or parsed.content:
        return None
    arguments = json.loads(parsed.calls[0].arguments)
    return arguments if set(arguments) == {"a", "b"} else None


def render_tool_prompts(template: str, conversations: list[list[dict]]) -> list[str]:
    """Prompts with the tools, ending at `<|im_start|>assistant\n` (thinking mode)."""
    compiled = compile_chat_template(template)
    return [compiled.render(messages=normalize_messages(m), tools=list(TOOLS),
                            add_generation_prompt=True) for m in conversations]


def evaluate_tool(problems: list[ToolProblem], template: str, generate) -> list[bool]:
    """Per problem, the whole loop: the model calls `add` with the right arguments, the
    call is run, and given its result the model answers exactly. `generate(prompts,
    max_tokens) -> texts`."""
    calls = [parse_call(t) for t in generate(
        render_tool_prompts(template, [p.messages for p in problems]), MAX_TOOL_TOKENS)]
    right = [c == {"a": p.a, "b": p.b} for c, p in zip(calls, problems)]
    follow = [p for p, ok in zip(problems, right) if ok]
    answers = generate(render_tool_prompts(template, [p.answer_messages() for p in follow]),
                       MAX_TOOL_TOKENS)
    exact = iter(final_answer(text) == p.answer for text, p in zip(answers, follow))
    return [ok and next(exact) for ok in right]


def format_results(results: dict[str, tuple[float, list[bool]]]) -> str:
    return "\n".join(f"{task} accuracy={acc:.3f} n={len(correct)}"
                     for task, (acc, correct) in results.items())


def _engine_kwargs(args) -> dict:
    names = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
             "num_gpu_blocks_override")
    kwargs = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.quantization is not None:
        kwargs["quantization"] = args.quantization
    if args.enable_prefix_caching is not None:
        kwargs["enable_prefix_caching"] = args.enable_prefix_caching
    return kwargs


def run_eval(args) -> int:
    if args.passes < 1:
        raise SystemExit(f"error: --passes must be at least 1, got {args.passes}")
    from serving.entrypoints.llm import LLM  # jax and the model: not for --help
    model = args.model or str(TINY_MODEL)
    llm = LLM(model=model, **_engine_kwargs(args))
    for number in range(args.passes):
        results = evaluate(llm, args.n, args.seed, model_path=model,
                           task_names=tuple(args.tasks.split(",")),
                           one_at_a_time=args.one_at_a_time)
        if args.passes > 1:
            print(f"# pass {number + 1}")
        print(format_results(results))
    stats = llm.stats()
    print(f"# engine: preemptions={stats['num_preemptions']} "
          f"prefix_cache_hit_rate={stats['prefix_cache_hit_rate']:.3f}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    from serving.bench.args import EVAL_DESCRIPTION, add_eval_args
    ap = argparse.ArgumentParser(description=EVAL_DESCRIPTION)
    add_eval_args(ap)
    return run_eval(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
