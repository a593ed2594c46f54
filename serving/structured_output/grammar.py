"""llguidance grammars from `StructuredOutputsParams`, and one guide (grammar state) per
constrained sequence; token_mask.py turns the guides of a step into its bitmask."""

from __future__ import annotations

import json
import threading
from typing import TYPE_CHECKING, cast

from serving.core.structured_params import COMPACT_JSON, StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

THINK_START, THINK_END, TURN_START = "<think>", "</think>", "<|im_start|>"
NO_SPACES = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _json_options(params: StructuredOutputsParams) -> JsonCompileOptions:
    if params.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": params.whitespace_pattern}
    return cast("JsonCompileOptions", NO_SPACES if params.disable_any_whitespace
                else COMPACT_JSON)


def body_grammar(params: StructuredOutputsParams) -> dict:
    """The constraint as one entry of llguidance's `{"grammars": [...]}` list (exactly one
    of the fields is set: StructuredOutputsParams checks it)."""
    import llguidance
    schema = params.schema
    if schema is not None:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                             defaults=_json_options(params))
        return json.loads(text)["grammars"][0]
    if params.regex is not None:
        return json.loads(llguidance.LLMatcher.grammar_from_regex(params.regex))["grammars"][0]
    if params.choice is not None:
        return {"lark_grammar": "start: " + " | ".join(json.dumps(c) for c in params.choice)}
    try:
        return {"lark_grammar": llguidance.grammar_from("grammar", params.grammar or "")}
    except ValueError as exc:
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


class GrammarCompiler:
    """Grammars for one tokenizer and model vocabulary. The llguidance tokenizer is built
    on first use (about 1.5 s for Qwen3's 151k tokens) and shared by every thread."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        ids = {t: tokenizer.backend.token_to_id(t) for t in (THINK_START, THINK_END, TURN_START)}
        self.think_ids = ((ids[THINK_START], ids[THINK_END])
                          if None not in (ids[THINK_START], ids[THINK_END]) else None)
        self.turn_start_id = ids[TURN_START]

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids)
            return self._ll_tokenizer

    def grammar(self, params: StructuredOutputsParams, thinking: bool) -> str:
        """Serialized llguidance grammar; `thinking`: an optional think block comes first
        (`<think>`, any tokens but `</think>`, `</think>`, up to two newlines as Qwen3
        writes them; unbounded newlines would let a model that wants to write something
        else newline forever), then the constraint."""
        body = {**body_grammar(params), "name": "body"}
        if not thinking or self.think_ids is None:
            return json.dumps({"grammars": [body]})
        start, end = self.think_ids
        wrapper = (f"start: think? @body\nthink: <[{start}]> <[^{end}]>* <[{end}]> NL\n"
                   "NL: /\\n{0,2}/\n")
        return json.dumps({"grammars": [{"name": "think", "lark_grammar": wrapper}, body]})

    def validate(self, params: StructuredOutputsParams) -> str:
        """'' when the constraint compiles, else llguidance's reason."""
        import llguidance
        try:
            grammar = self.grammar(params, thinking=False)
        except ValueError as exc:
            return str(exc)
        return llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)

    def thinking_first(self, params: StructuredOutputsParams, prompt_ids: list[int]) -> bool:
        """Whether the constraint waits for a think block: asked for, the tokenizer has the
        tags, and the prompt's last turn has not already closed one (enable_thinking=False
        renders `<think>\\n\\n</think>` into the prompt)."""
        if not params.reasoning or self.think_ids is None:
            return False
        last_turn = 0
        if self.turn_start_id is not None and self.turn_start_id in prompt_ids:
            last_turn = len(prompt_ids) - prompt_ids[::-1].index(self.turn_start_id)
        return self.think_ids[1] not in prompt_ids[last_turn:]

    def guide(self, params: StructuredOutputsParams, prompt_ids: list[int]) -> Guide:
        import llguidance
        grammar = self.grammar(params, self.thinking_first(params, prompt_ids))
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return Guide(matcher)


class Guide:
    """One sequence's guide: which tokens may come next, advanced by each sampled one (over
    llguidance's matcher)."""

    def __init__(self, matcher):
        self.matcher = matcher

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; False if the grammar rejects it (then the matcher
        stays in its error state)."""
        return self.matcher.is_stopped() or self.matcher.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (drafts) the grammar allows in a row from here; the
        matcher does not move."""
        if not tokens or self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        return int(self.matcher.validate_tokens(tokens))
