"""lm-evaluation-harness (`local-completions`) against the shipped tiny model's server, as
evaluation runs point it at vLLM: a multiple-choice task built here from the model's own
reverse and sort problems, scored by loglikelihood (token-id prompts, `echo`,
`logprobs`), and a generation task scored by exact match. The model answers these
problems right (1.000 on 500 of each, docs/benchmarks.md), so both score 1.0; a server
whose prompt logprobs were off (shifted a position, or another token's) would rank the
distractors higher and score well below."""

from __future__ import annotations

import json

import pytest

from qwen_jax import tasks
from qwen_jax.weights import DEFAULT_MODEL_DIR
from serving.bench.eval_tasks import chat_template, render_prompts
from tests.server.conftest import EMBEDDED_MODEL, serve_embedded_model

MODEL = EMBEDDED_MODEL
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    with serve_embedded_model(tmp_path_factory.mktemp("xla")) as srv:
        yield srv.url


def _distractors(problem) -> list[str]:
    """Wrong answers of the same digits: the list as given, reversed, sorted, shuffled."""
    digits = problem.prompt.split(": ")[1].split()
    candidates = [digits, digits[::-1], sorted(digits), sorted(digits, reverse=True),
                  digits[1:] + digits[:1]]
    wrong = []
    for candidate in candidates:
        text = " ".join(candidate)
        if text != problem.answer and text not in wrong:
            wrong.append(text)
    return wrong[:3]


def _write_tasks(directory) -> int:
    problems = [p for t in ("reverse", "sort") for p in tasks.problems(t, 12, seed=31)]
    problems = [p for p in problems if len(_distractors(p)) >= 2]
    prompts = render_prompts(problems, chat_template(DEFAULT_MODEL_DIR))
    with open(directory / "mc.jsonl", "w") as f:
        for problem, prompt in zip(problems, prompts):
            wrong = _distractors(problem)
            f.write(json.dumps({"context": prompt + EMPTY_THINK,
                                "choices": [*wrong[:1], problem.answer, *wrong[1:]],
                                "label": 1}) + "\n")
    with open(directory / "gen.jsonl", "w") as f:
        for problem, prompt in zip(problems, prompts):
            f.write(json.dumps({"context": prompt, "answer": problem.answer}) + "\n")
    (directory / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
""")
    (directory / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {directory / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["<|im_end|>"]
  max_gen_toks: 48
  do_sample: false
  temperature: 0
filter_list:
  - name: answer
    filter:
      - function: regex
        regex_pattern: "</think>\\\\s*(.*)$"
      - function: take_first
metric_list:
  - metric: exact_match
""")
    return len(problems)


def test_lm_eval_scores_the_models_accuracy(server_url, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    num = _write_tasks(tmp_path)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    results = simple_evaluate(
        model="local-completions",
        model_args=(f"model={MODEL},base_url={server_url}/v1/completions,"
                    f"tokenizer_backend=huggingface,tokenizer={DEFAULT_MODEL_DIR},"
                    "num_concurrent=1,max_retries=1,max_length=512"),
        tasks=["tiny_mc", "tiny_gen"], task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True)
    scores = results["results"]
    assert scores["tiny_mc"]["acc,none"] == 1.0, scores
    assert scores["tiny_gen"]["exact_match,answer"] == 1.0, scores
    assert len(results["samples"]["tiny_mc"]) == num
    # every loglikelihood request went through echo: each choice's continuation is greedy
    for sample in results["samples"]["tiny_mc"]:
        (best_lp, greedy) = sample["resps"][1][0]
        assert greedy and all(best_lp > r[0][0] for i, r in enumerate(sample["resps"])
                              if i != 1)
