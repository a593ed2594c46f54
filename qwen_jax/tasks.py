"""Generated chat tasks with exact answers, shared by the tiny model's training and its eval.

Each task maps a numpy Generator to a `Problem` (user prompt, exact answer). Training and
evaluation draw from differently seeded generators (`problems(..., split=...)`), so eval
problems are held out by seed. The `copy` task hides a code early in a long filler text
(a few hundred tokens), so answering it needs attention across many KV-cache pages. The
`tool` task (qwen_jax/tool_task.py) calls a tool, then answers from its result.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Callable

import numpy as np

from qwen_jax.tool_task import ToolProblem

TASKS = ("add", "reverse", "sort", "copy")  # one user message, one assistant turn
ALL_TASKS = (*TASKS, "tool")  # + the two-turn tool task (qwen_jax/tool_task.py)
_SPLIT_SEEDS = {"train": 0, "eval": 1_000_003}

# Filler vocabulary of the copy task: lowercase words, so the uppercase code is unique.
FILLER_WORDS = tuple("""
the a an and or but so of to in on at by for with from into over under after before
cat dog bird fish tree river stone cloud rain snow wind sun moon star hill road house
door window garden field forest city town ship boat train car book page letter word
song voice light dark cold warm green blue red white black old new small big long short
quick slow quiet loud bright soft hard early late near far high low deep wide open
walks runs sits sleeps sings reads writes sees hears finds keeps holds takes gives makes
goes comes turns waits stays falls rises grows moves looks calls helps plays thinks
""".split())


@dataclasses.dataclass(frozen=True)
class Problem:
    task: str
    prompt: str  # the user message
    answer: str  # the exact final answer (the reply after the think block)
    reasoning: str = ""  # what the model writes inside <think>...</think> ("" for none)

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.prompt}]

    @property
    def completion(self) -> str:
        """The whole assistant turn after `<|im_start|>assistant\n`, as Qwen3 writes it."""
        return f"<think>\n{self.reasoning}\n</think>\n\n{self.answer}"

    def turns(self) -> list[tuple[list[dict], tuple, str]]:
        """(messages, tools, completion) for each assistant turn, as trained."""
        return [(self.messages, (), self.completion)]


def _number(rng: np.random.Generator, max_digits: int) -> int:
    digits = int(rng.integers(1, max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10 ** digits))


def make_add(rng: np.random.Generator) -> Problem:
    """The model thinks first: the sum's digits, ones first (the order the carries flow)."""
    a, b = _number(rng, 3), _number(rng, 3)
    return Problem("add", f"What is {a} + {b}?", str(a + b), " ".join(str(a + b)[::-1]))


def _digit_list(rng: np.random.Generator) -> list[int]:
    return [int(d) for d in rng.integers(0, 10, size=int(rng.integers(3, 9)))]


def make_reverse(rng: np.random.Generator) -> Problem:
    items = _digit_list(rng)
    return Problem("reverse", "Reverse the list: " + " ".join(map(str, items)),
                   " ".join(map(str, items[::-1])))


def make_sort(rng: np.random.Generator) -> Problem:
    items = _digit_list(rng)
    return Problem("sort", "Sort the list: " + " ".join(map(str, items)),
                   " ".join(map(str, sorted(items))))


def _filler(rng: np.random.Generator, num_words: int) -> str:
    return " ".join(FILLER_WORDS[i] for i in rng.integers(0, len(FILLER_WORDS), size=num_words))


def make_copy(rng: np.random.Generator, min_words: int = 150, max_words: int = 300) -> Problem:
    """A code of 4-8 distinct capitals, then min-max filler words, then the question.

    Evaluation uses the default 150-300 words; training may start shorter (a curriculum)."""
    length = int(rng.integers(4, 9))
    code = "".join(rng.choice(list(string.ascii_uppercase), size=length, replace=False))
    num_words = int(rng.integers(min_words, max_words + 1))
    before = int(rng.integers(0, min(40, num_words) + 1))
    text = (f"{_filler(rng, before)}\ncode:\n{code}\n{_filler(rng, num_words - before)}"
            f"\nWhat was the code?")
    return Problem("copy", "Remember the code.\n" + text.lstrip("\n"), code)


def make_tool(rng: np.random.Generator) -> ToolProblem:
    return ToolProblem("tool", _number(rng, 3), _number(rng, 3))


AnyProblem = Problem | ToolProblem
MAKERS: dict[str, Callable[[np.random.Generator], AnyProblem]] = {
    "add": make_add, "reverse": make_reverse, "sort": make_sort, "copy": make_copy,
    "tool": make_tool}


def task_rng(task: str, split: str, seed: int) -> np.random.Generator:
    if split not in _SPLIT_SEEDS:
        raise ValueError(f"split must be one of {', '.join(_SPLIT_SEEDS)}, got {split!r}")
    return np.random.default_rng([_SPLIT_SEEDS[split], ALL_TASKS.index(task), seed])


def problems(task: str, n: int, *, seed: int = 0, split: str = "eval") -> list[AnyProblem]:
    """n problems of `task`, reproducible from (split, task, seed)."""
    if task not in MAKERS:
        raise ValueError(f"task must be one of {', '.join(ALL_TASKS)}, got {task!r}")
    rng = task_rng(task, split, seed)
    return [MAKERS[task](rng) for _ in range(n)]
