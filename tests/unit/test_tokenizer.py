"""Tokenizer loading, encode/decode and the chat template (parity with transformers), on the
real Qwen3 tokenizer files."""

import json
import random

import jinja2
import pytest
import tokenizers

from qwen_jax.tokenizer import Tokenizer
from tests.helpers.fixtures import QWEN3_TOKENIZER as QWEN3_DIR
from tests.helpers.text import random_text

IM_START, IM_END, ENDOFTEXT, THINK = 151644, 151645, 151643, 151667

SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi there"}],
    "system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "<think>\nEasy.\n</think>\n\nBlue."},
        {"role": "user", "content": "Another, in 中文 please 🙂"},
    ],
    "ends_with_assistant": [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi! How can I help?"},
    ],
    "reasoning_alias": [
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because.", "reasoning": "Think first."},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "weather",
                                              "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
}
TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Current weather for a city — °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

@pytest.fixture(scope="module")
def hf_tok(tok):
    import transformers
    return transformers.AutoTokenizer.from_pretrained(str(QWEN3_DIR))


def write_tiny_checkpoint(path, config=None, **files):
    """A word-level tokenizer.json with its own special tokens, plus the given files."""
    vocab = {"<unk>": 0, "hello": 1, "world": 2, "<eos>": 3, "<pad>": 4, "<eot>": 5}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<eos>", "<pad>"])
    backend.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<eos>", "pad_token": {"content": "<pad>"}, **(config or {})}
    files["tokenizer_config.json"] = json.dumps(config)
    for name, content in files.items():
        (path / name).write_text(content)
    return path


# --- loading -------------------------------------------------------------------------------

def test_missing_tokenizer_json_returns_none(tmp_path):
    assert Tokenizer.from_dir(tmp_path) is None
    assert Tokenizer.from_dir(tmp_path / "does-not-exist") is None


def test_special_ids_and_vocab(tok):
    assert tok.vocab_size == 151669
    assert tok.eos_token_id == IM_END
    assert tok.eos_token_ids == (IM_END,)
    assert tok.pad_token_id == ENDOFTEXT
    assert {IM_START, IM_END, ENDOFTEXT} <= tok.all_special_ids
    assert THINK not in tok.all_special_ids  # <think> is an added, non-special token
    assert tok.id_to_token(IM_START) == "<|im_start|>"
    assert tok.id_to_token(THINK) == "<think>"


def test_all_special_ids_match_transformers(tok, hf_tok):
    assert tok.all_special_ids == set(hf_tok.all_special_ids)
    assert tok.vocab_size == len(hf_tok)


@pytest.mark.parametrize("generation_eos, expected", [
    (None, (3,)),
    (3, (3,)),
    ([5, 3], (5, 3)),
    (5, (5, 3)),
])
def test_generation_config_eos_ids_join_the_eos_token(tmp_path, generation_eos, expected):
    files = {} if generation_eos is None else {
        "generation_config.json": json.dumps({"eos_token_id": generation_eos})}
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path, **files))
    assert loaded.eos_token_id == 3
    assert loaded.eos_token_ids == expected
    assert loaded.pad_token_id == 4
    assert loaded.all_special_ids == {3, 4}


def test_config_added_tokens_missing_from_tokenizer_json_are_added(tmp_path):
    added = {"6": {"content": "<tool>", "special": True}, "3": {"content": "<eos>"}}
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(
        tmp_path, {"added_tokens_decoder": added, "additional_special_tokens": ["<tool>"]}))
    assert loaded.encode("hello <tool> world") == [1, 6, 2]
    assert loaded.vocab_size == 7 and 6 in loaded.all_special_ids
    assert loaded.decode([1, 6, 2]) == "hello world"


def test_chat_template_jinja_file_overrides_config(tmp_path):
    template = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}{{ eos_token }}"
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(
        tmp_path, {"chat_template": "ignored"}, **{"chat_template.jinja": template}))
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "[user:x]<eos>"


def test_named_chat_templates_use_default(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path, {"chat_template": named}))
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


def test_missing_chat_template_raises(tmp_path):
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path))
    with pytest.raises(ValueError, match="chat_template"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])


# --- encode / decode -----------------------------------------------------------------------

def test_known_encoding_adds_no_bos(tok):
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]
    assert tok.encode("Hello, world!", add_special_tokens=True) == [9707, 11, 1879, 0]


@pytest.mark.parametrize("text", [
    "Hello, world!", "  leading and trailing  \n", "你好，世界！",
    "emoji 🤖🎉👩‍💻🇫🇷",
    "mixed naïve café ∑x² Ελληνικά", "<think>\nreasoning\n</think>\n\nanswer", "",
])
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_encode_as_one_id_and_skip_on_decode(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == IM_START and ids[-1] == IM_END
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_encode_decode_match_transformers(tok, hf_tok):
    text = random_text(random.Random(0), 200)
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids + [IM_END]) == hf_tok.decode(ids + [IM_END], skip_special_tokens=True)


# --- chat template -------------------------------------------------------------------------

def test_chat_template_literal_qwen3_format(tok):
    messages = CONVERSATIONS["system"]
    prompt = ("<|im_start|>system\nYou are terse.<|im_end|>\n"
              "<|im_start|>user\nWhat is 2+2?<|im_end|>\n")
    assert tok.apply_chat_template(messages) == prompt + "<|im_start|>assistant\n"
    assert (tok.apply_chat_template(messages, enable_thinking=False)
            == prompt + "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == prompt


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("kwargs", [
    {"enable_thinking": True}, {"enable_thinking": False}, {},
    {"add_generation_prompt": False},
], ids=["thinking", "no_thinking", "default", "no_generation_prompt"])
def test_chat_template_matches_transformers(tok, hf_tok, name, kwargs):
    messages = CONVERSATIONS[name]
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == expected


def test_chat_template_with_tools_matches_transformers(tok, hf_tok):
    messages = CONVERSATIONS["system"]
    expected = hf_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True)
    text = tok.apply_chat_template(messages, tools=TOOLS)
    assert text == expected
    assert "Current weather for a city — °C" in text  # tojson keeps non-ASCII


def test_chat_template_tokenize_matches_transformers(tok, hf_tok):
    messages = CONVERSATIONS["multi_turn"]
    ids = tok.apply_chat_template(messages, tokenize=True, enable_thinking=False)
    expected = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                          enable_thinking=False)
    assert ids == list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert ids[0] == IM_START


def test_text_parts_are_joined(tok):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    assert as_parts == tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])


@pytest.mark.parametrize("messages, field", [
    ([], "messages"),
    ("hello", "messages"),
    (["hello"], r"messages\[0\]"),
    ([{"content": "x"}], r"messages\[0\]\.role"),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "x"}],
     r"messages\[1\]\.role"),
    ([{"role": "user"}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": 7}], r"messages\[0\]\.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
     r"messages\[0\]\.content\[0\]"),
])
def test_invalid_messages_raise_naming_the_field(tok, messages, field):
    with pytest.raises(ValueError, match=field):
        tok.apply_chat_template(messages)


def test_template_raise_exception_is_a_template_error(tmp_path):
    template = "{{ raise_exception('no tools here') }}"
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path, {"chat_template": template}))
    with pytest.raises(jinja2.TemplateError, match="no tools here"):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(tmp_path):
    template = "{{ messages.__class__.__mro__ }}"
    loaded = Tokenizer.from_dir(write_tiny_checkpoint(tmp_path, {"chat_template": template}))
    with pytest.raises(jinja2.exceptions.SecurityError):
        loaded.apply_chat_template([{"role": "user", "content": "x"}])
