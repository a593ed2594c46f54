"""Qwen3 reasoning parser: whole-text extraction, and streaming that agrees with it however
the text is cut into deltas."""

import pytest

from serving.parsers.reasoning import Qwen3ReasoningParser, reasoning_parser_class

THINKING = "<think>\n2 3 4\n</think>\n\n432"
EMPTY_THINK = "<think>\n\n</think>\n\nHELLO"
CUT_OFF = "<think>\nstill thinking\n</th"
NO_THINK = "\n432 and <think> x"  # enable_thinking=False: the prompt held the think block

CASES = [(THINKING, "2 3 4", "432"), (EMPTY_THINK, None, "HELLO"),
         (CUT_OFF, "still thinking\n</th", None), ("<think>\n2 3\n\n", "2 3", None),
         ("<think>a\n</think>", "a", None), ("<think>\nx\n\ny\n</think>\nz\n", "x\n\ny", "z\n"),
         (NO_THINK, None, NO_THINK), ("432", None, "432"), ("<thi", None, "<thi"),
         ("", None, "")]


def stream(parser: Qwen3ReasoningParser, deltas: list[str]) -> tuple[str, str]:
    reasoning = content = ""
    for i, delta in enumerate(deltas):
        r, c = parser.feed(delta, finished=i == len(deltas) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def splits(text: str):
    """Every cut of `text` into two deltas, one character per delta, and the whole text."""
    yield [text]
    yield list(text) or [""]
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_extract(text, reasoning, content):
    assert Qwen3ReasoningParser.extract(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_streaming_agrees_with_extract_for_every_split(text, reasoning, content):
    for deltas in splits(text):
        assert stream(Qwen3ReasoningParser(), deltas) == (reasoning or "", content or ""), deltas


def test_tags_split_across_deltas_are_held_back_until_resolved():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<th") == ("", "")
    assert parser.feed("ink>\n2 3") == ("2 3", "")
    assert parser.feed(" 4\n</thi") == (" 4", "")
    assert parser.feed("nk>\n") == ("", "")
    assert parser.feed("\n432") == ("", "432")
    assert parser.feed("", finished=True) == ("", "")


def test_tags_and_text_in_one_delta():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>\nab\n</think>\n\ncd") == ("ab", "cd")
    assert parser.feed(" <think>") == ("", " <think>")  # after the block, tags are content


def test_no_think_block_is_all_content_at_once():
    parser = Qwen3ReasoningParser()
    assert parser.feed("4") == ("", "4")
    assert parser.feed("\n32") == ("", "\n32")


def test_cut_off_thinking_flushes_the_held_back_tail_as_reasoning():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<think>\nhmm\n</") == ("hmm", "")
    assert parser.feed("", finished=True) == ("\n</", "")


def test_an_unopened_end_tag_splits_only_whole_text():
    # Streaming must decide at the first characters; extract can look ahead.
    assert Qwen3ReasoningParser.extract("a\n</think>\n\nb") == ("a", "b")
    assert stream(Qwen3ReasoningParser(), ["a\n", "</think>\n\nb"]) == ("", "a\n</think>\n\nb")


def test_unknown_parser_name_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"reasoning_parser must be one of \['qwen3'\], "
                                         r"got 'deepseek_r1'"):
        reasoning_parser_class("deepseek_r1")
