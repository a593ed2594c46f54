"""The generated tasks of the tiny model: exact answers, the add think block, held-out
splits, the copy curriculum's lengths, and clear errors."""

from __future__ import annotations

import re

import pytest

from qwen_jax import tasks


def test_add_answers_are_sums_and_think_block_holds_digits_ones_first():
    for p in tasks.problems("add", 300, split="train"):
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", p.prompt).groups())
        assert p.answer == str(a + b)
        assert p.reasoning.split(" ") == list(p.answer[::-1])
        assert p.completion == f"<think>\n{p.reasoning}\n</think>\n\n{p.answer}"


def test_list_answers_are_reversed_and_sorted_with_empty_think_block():
    for p in tasks.problems("reverse", 100):
        items = p.prompt.removeprefix("Reverse the list: ").split()
        assert p.answer.split() == items[::-1] and 3 <= len(items) <= 8
        # the same tokens as an enable_thinking=False prompt followed by the answer
        assert p.completion == "<think>\n\n</think>\n\n" + p.answer
    for p in tasks.problems("sort", 100):
        items = p.prompt.removeprefix("Sort the list: ").split()
        assert p.answer.split() == sorted(items) and p.reasoning == ""


def test_copy_code_is_the_only_capitals_after_the_instruction():
    for p in tasks.problems("copy", 50):
        body = p.prompt.removeprefix("Remember the code.\n")
        assert re.findall(r"[A-Z]{2,}", body) == [p.answer]
        assert 4 <= len(p.answer) == len(set(p.answer)) <= 8
        filler = body.split("What was the code?")[0].replace(p.answer, "").replace("code:", "")
        assert 150 <= len(filler.split()) <= 300


def test_copy_curriculum_lengths_are_respected():
    import numpy as np
    rng = np.random.default_rng(0)
    for _ in range(50):
        p = tasks.make_copy(rng, min_words=8, max_words=16)
        filler = p.prompt.split("\n", 1)[1].replace("code:", "").replace(p.answer, "")
        assert 8 <= len(filler.replace("What was the code?", "").split()) <= 16


def test_eval_problems_are_seeded_apart_from_training():
    for task in tasks.TASKS:
        train = {p.prompt for p in tasks.problems(task, 200, split="train")}
        held_out = tasks.problems(task, 200, split="eval")
        assert held_out == tasks.problems(task, 200, split="eval")  # reproducible
        assert sum(p.prompt in train for p in held_out) < 20  # only chance collisions


@pytest.mark.parametrize("kwargs, field", [
    (dict(task="mul", n=1), "task"),
    (dict(task="add", n=1, split="test"), "split"),
])
def test_bad_task_or_split_is_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tasks.problems(**kwargs)


def test_tool_problems_call_add_then_answer_from_the_result():
    from qwen_jax import tool_task
    from serving.bench.eval_tasks import parse_call
    for p in tasks.problems("tool", 50):
        a, b = map(int, re.fullmatch(r"Use the tool to add (\d+) and (\d+)\.", p.prompt).groups())
        (m1, tools1, call), (m2, tools2, answer) = p.turns()
        assert tools1 == tools2 == tool_task.TOOLS and m1 == p.messages
        assert call == ("<think>\n\n</think>\n\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
                        f"{{\"a\": {a}, \"b\": {b}}}}}\n</tool_call>")
        assert parse_call(call) == {"a": a, "b": b}
        assert m2[-1] == {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)}
        assert answer.endswith(f"{a} + {b} = {a + b}")
