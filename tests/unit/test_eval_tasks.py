"""Scoring of the tiny model's tasks: the final answer is what follows the think block; the
tool task scores the whole loop (the call, then the answer from its result)."""

from qwen_jax import tool_task
from serving.bench.eval_tasks import (
    TINY_MODEL,
    chat_template,
    evaluate_tool,
    final_answer,
    parse_call,
)


def test_final_answer_is_the_text_after_the_think_block():
    assert final_answer("<think>\n2 3 4\n</think>\n\n432") == "432"
    assert final_answer("<think>\n\n</think>\n\n1 2 3") == "1 2 3"
    assert final_answer(" 432\n") == "432"  # no think block: the whole reply


def test_tool_eval_scores_the_whole_loop():
    problems = [tool_task.ToolProblem("tool", 3, 4), tool_task.ToolProblem("tool", 10, 20)]
    replies = {  # what a fake model writes for each prompt's last user message
        "Use the tool to add 3 and 4.": problems[0].call_text,
        "Use the tool to add 10 and 20.": problems[1].call_text.replace("20", "21"),
        "<tool_response>\n7\n</tool_response>": "<think>\n\n</think>\n\n3 + 4 = 7"}

    def generate(prompts, max_tokens):
        assert max_tokens == tool_task.MAX_TOOL_TOKENS
        return [next(v for k, v in replies.items() if k in p.rsplit("<|im_start|>", 2)[-2])
                for p in prompts]
    assert evaluate_tool(problems, chat_template(TINY_MODEL), generate) == [True, False]
    assert parse_call("<tool_call>\n{broken}\n</tool_call>") is None
    assert parse_call("text first " + problems[0].call_text) is None
