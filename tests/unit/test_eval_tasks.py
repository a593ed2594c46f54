"""Scoring of the tiny model's tasks: the final answer is what follows the think block."""

from serving.eval_tasks import final_answer


def test_final_answer_is_the_text_after_the_think_block():
    assert final_answer("<think>\n2 3 4\n</think>\n\n432") == "432"
    assert final_answer("<think>\n\n</think>\n\n1 2 3") == "1 2 3"
    assert final_answer(" 432\n") == "432"  # no think block: the whole reply
