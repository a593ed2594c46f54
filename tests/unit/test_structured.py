"""Structured outputs on the host with Qwen3's real tokenizer: params checks, llguidance
grammars and their errors, where the constraint starts with thinking, and the masks."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_jax.tokenizer import Tokenizer
from serving.core.request import SamplingParams
from serving.core.structured_params import StructuredOutputsParams
from serving.structured_output.grammar import GrammarCompiler
from serving.structured_output.token_mask import MaskBuilder
from tests.helpers.fixtures import QWEN3_TOKENIZER

VOCAB = 151936
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(QWEN3_TOKENIZER)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, tok.eos_token_ids)


def allowed(mask_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")))


def accepts(compiler, tok, params, text: str, prompt=()) -> bool:
    guide = compiler.guide(params, list(prompt))
    return all(guide.accept(t) for t in tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("fields", [
    {"json": SCHEMA}, {"json": '{"type": "array"}'}, {"json_object": True},
    {"regex": r"\d{3}-[a-z]+"}, {"choice": ["yes", "no"]},
    {"grammar": 'start: "a" b\nb: "b"+'}, {"grammar": 'root ::= "x" | "y"'}])
def test_valid_constraints_compile(compiler, fields):
    assert compiler.validate(StructuredOutputsParams(**fields)) == ""


@pytest.mark.parametrize("fields, reason", [
    ({"json": {"type": "nope"}}, "nope"), ({"regex": "[a-"}, "regex"),
    ({"grammar": "start: missing"}, "missing"), ({"json": "{not json"}, "not valid JSON")])
def test_invalid_constraints_give_the_reason(compiler, fields, reason):
    assert reason in compiler.validate(StructuredOutputsParams(**fields))


@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one"), ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "choice"), ({"choice": "yes"}, "choice"), ({"json": 5}, "json"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "disable_any_whitespace")])
def test_params_refuse_bad_shapes_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_from_dict_names_unknown_and_unsupported_keys():
    with pytest.raises(ValueError, match="regx"):
        StructuredOutputsParams.from_dict({"regx": "a"})
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams.from_dict({"structural_tag": "{}"})
    params = StructuredOutputsParams.from_dict({"regex": "a", "disable_fallback": True})
    assert params.kind == "regex"
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.choice == ["a"]
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs={"choice": ["a"]}, min_tokens=1)


def test_json_is_compact_with_dumps_separators_by_default(compiler, tok):
    params = StructuredOutputsParams(json=SCHEMA)
    assert accepts(compiler, tok, params, '{"n": 12}')
    assert not accepts(compiler, tok, params, '{"n":12}')
    assert not accepts(compiler, tok, params, '{ "n": 12}')
    assert accepts(compiler, tok, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                   '{"n":12}')
    free = StructuredOutputsParams(json=SCHEMA, whitespace_pattern=r"[ \n]{0,4}")
    assert accepts(compiler, tok, free, '{\n  "n" : 12 }')


def test_constraint_starts_after_the_think_block(compiler, tok):
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning=True)
    thinking = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=True)
    assert compiler.thinking_first(params, thinking)
    assert accepts(compiler, tok, params, "<think>\nmaybe...\n</think>\n\nyes", thinking)
    assert not accepts(compiler, tok, params, "<think>\nok\n</think>\n\nmaybe", thinking)
    assert accepts(compiler, tok, params, "no", thinking)  # a reply without a think block


def test_prompt_that_closed_thinking_constrains_from_the_first_token(compiler, tok):
    params = StructuredOutputsParams(choice=["yes"], reasoning=True)
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": "<think>\nx\n</think>\n\nb"},
               {"role": "user", "content": "c"}]
    closed = tok.apply_chat_template(history, tokenize=True, enable_thinking=False)
    assert not compiler.thinking_first(params, closed)
    assert not accepts(compiler, tok, params, "<think>\n</think>\n\nyes", closed)
    # an earlier turn's </think> does not count: the new turn still thinks first
    assert compiler.thinking_first(params, tok.apply_chat_template(history, tokenize=True))
    assert not compiler.thinking_first(StructuredOutputsParams(choice=["yes"]), [])


def test_mask_rows_allow_what_the_grammar_allows(compiler, tok):
    guide = compiler.guide(StructuredOutputsParams(choice=["yes", "no"]), [])
    mask = MaskBuilder(VOCAB).submit([(1, guide, [], [])], 4).result()
    assert mask.active and mask.bits.shape == (4, VOCAB // 32)
    first = allowed(mask.bits[1])
    assert tok.encode("yes")[0] in first and tok.encode("no")[0] in first
    assert tok.encode("maybe")[0] not in first and len(first) < 10
    assert all((mask.bits[r] == -1).all() for r in (0, 2, 3))  # other rows: everything
    assert MaskBuilder(VOCAB).submit([], 4) is None  # no constrained row: no mask at all


def test_draft_rows_are_masked_by_the_grammar_after_their_drafts(compiler, tok):
    # speculative decoding: the sequence's row reads the guide's state; draft row j the
    # state after drafts 0..j; the guide is back where it was afterwards
    params = StructuredOutputsParams(choice=["alpha beta gamma", "alpha delta"])
    drafts = tok.encode("alpha beta", add_special_tokens=False)
    guide = compiler.guide(params, [])
    assert guide.valid_prefix(drafts + tok.encode(" zeta", add_special_tokens=False)) == len(
        drafts)  # the first draft the grammar forbids ends them
    draft_rows = [2 + j for j in range(len(drafts))]
    mask = MaskBuilder(VOCAB).submit([(1, guide, draft_rows, drafts)], 8).result()
    for j, row in enumerate([1, *draft_rows]):
        alone = compiler.guide(params, [])
        assert all(alone.accept(t) for t in drafts[:j])
        want = MaskBuilder(VOCAB).submit([(0, alone, [], [])], 1).result()
        assert allowed(mask.bits[row]) == allowed(want.bits[0]), row
    assert allowed(mask.bits[1]) != allowed(mask.bits[draft_rows[-1]])
    again = MaskBuilder(VOCAB).submit([(0, guide, [], [])], 1).result()
    assert allowed(again.bits[0]) == allowed(mask.bits[1])  # rolled back


def test_finished_grammar_allows_only_eos(compiler, tok):
    guide = compiler.guide(StructuredOutputsParams(choice=["yes"]), [])
    assert all(guide.accept(t) for t in tok.encode("yes"))
    mask = MaskBuilder(VOCAB).submit([(0, guide, [], [])], 1).result()
    assert allowed(mask.bits[0]) <= set(tok.eos_token_ids) and allowed(mask.bits[0])


def test_tool_call_grammar_after_a_think_block(compiler, tok):
    from serving.parsers.tool_parsers import calls_grammar
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    ids = {t: tok.backend.token_to_id(t) for t in ("<tool_call>", "</tool_call>")}
    params = StructuredOutputsParams(grammar=calls_grammar(tools, True, ids), reasoning=True)
    prompt = tok.apply_chat_template([{"role": "user", "content": "q"}], tokenize=True)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert accepts(compiler, tok, params, "<think>\nadd it\n</think>\n\n" + call, prompt)
    assert accepts(compiler, tok, params, call + "\n" + call, prompt)
    assert not accepts(compiler, tok, params, "<think>\nno\n</think>\n\nSure!", prompt)
    assert not accepts(compiler, tok, params, call.replace('"a": 1', '"b": 1'), prompt)
