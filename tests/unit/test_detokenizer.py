"""Streaming detokenization and stop strings, on the real Qwen3 tokenizer files."""

import random

import pytest

from serving.engine.detokenizer import IncrementalDetokenizer
from tests.helpers.text import random_text

IM_END = 151645

def stream(detok, ids, rng=None):
    """Feeds ids in random-size chunks; returns the deltas, flush last."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4) if rng else 1
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


# --- incremental detokenization ------------------------------------------------------------

def test_fixture_text_splits_characters_across_tokens(tok):
    ids = tok.encode(" 🤖")
    assert len(ids) > 1 and any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("seed", range(5))
def test_incremental_equals_full_decode_for_mixed_text(tok, seed):
    rng = random.Random(seed)
    prompt = tok.encode("Prompt: 日本 🤖")
    ids = tok.encode(random_text(rng))
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, rng)
    assert "".join(deltas) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("seed", range(3))
def test_incremental_equals_full_decode_for_random_ids(tok, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    ids += [rng.randrange(124, 256) for _ in range(100)]  # byte tokens: many partial characters
    rng.shuffle(ids)
    for skip_special_tokens in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip_special_tokens)
        deltas = stream(detok, ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip_special_tokens)


def random_ids(tok, rng, num: int = 400) -> list[int]:
    """Random token ids, 30% of them byte tokens: many characters split across tokens."""
    return [rng.randrange(124, 256) if rng.random() < 0.3 else rng.randrange(tok.vocab_size)
            for _ in range(num)]


class WindowOnly:
    """The tokenizer without its byte table: the detokenizer takes the window path."""

    def __init__(self, tok):
        self.backend, self.decode = tok.backend, tok.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_table_decodes_every_id_as_the_tokenizer_does(tok, skip_special_tokens):
    table = tok.token_bytes(skip_special_tokens)
    assert table is not None and len(table) == tok.vocab_size  # Qwen's decoder is ByteLevel
    ids = tok.encode("naïve 🤖 日本<|im_end|>") + [IM_END]
    joined = b"".join(table[i] for i in ids).decode("utf-8", "replace")
    assert joined == tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("seed", range(3))
def test_byte_table_and_window_paths_give_the_same_text(tok, seed):
    rng = random.Random(seed)
    prompt, ids = tok.encode("Prompt: 日本 🤖"), random_ids(tok, rng)
    fast = IncrementalDetokenizer(tok, prompt)
    window = IncrementalDetokenizer(WindowOnly(tok), prompt)
    assert fast._bytes is not None and window._bytes is None
    deltas = [fast.add([i]) for i in ids] + [fast.flush()]
    assert "".join(deltas) == fast.text == window.add(ids) + window.flush() == window.text
    # Valid text: never a U+FFFD mid-stream, and the byte path is never behind the window
    # path (it emits a token's complete characters before a split one: " " of " \xe2\x88")
    valid = tok.encode(random_text(rng))
    fast, window = IncrementalDetokenizer(tok, prompt), IncrementalDetokenizer(WindowOnly(tok),
                                                                               prompt)
    for i in valid:
        delta = fast.add([i])
        window.add([i])
        assert "\ufffd" not in delta and fast.text.startswith(window.text)
    fast.flush()
    window.flush()
    assert fast.text == window.text == tok.decode(valid)


@pytest.mark.parametrize("seed", range(3))
def test_rust_decode_stream_and_python_path_give_the_same_deltas(tok, seed):
    rng = random.Random(seed)
    prompt, ids = tok.encode("Prompt: 日本 🤖"), random_ids(tok, rng)
    fast = IncrementalDetokenizer(WindowOnly(tok), prompt)
    slow = IncrementalDetokenizer(WindowOnly(tok), prompt)
    assert fast._stream is not None  # the tokenizers library here has DecodeStream
    slow._stream = None
    assert [fast.add([i]) for i in ids] == [slow.add([i]) for i in ids]
    assert fast.flush() == slow.flush() and fast.text == slow.text


def test_decode_stream_error_falls_back_to_python_decoding(tok):
    class Failing:
        def step(self, backend, token_id):
            raise RuntimeError("prefix mismatch")

    ids = tok.encode("naïve 🤖 text")
    detok = IncrementalDetokenizer(WindowOnly(tok), [])
    emitted = detok.add(ids[:2])
    detok._stream = Failing()
    emitted += detok.add(ids[2:]) + detok.flush()
    assert emitted == detok.text == tok.decode(ids) and detok._stream is None


def test_incomplete_character_is_held_until_complete(tok):
    robot = tok.encode("🤖")
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add([i]) for i in robot] == [""] * (len(robot) - 1) + ["🤖"]


def test_special_tokens_kept_when_not_skipped(tok):
    ids = tok.encode("answer<|im_end|>")
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "answer"
    kept = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "answer<|im_end|>"


# --- stop strings --------------------------------------------------------------------------

def check_stream_is_prefix_of_final(detok, ids):
    """Streams one token at a time; every emitted prefix must survive in the final text."""
    emitted = ""
    for i in ids:
        emitted += detok.add([i])
        assert detok.text.startswith(emitted)
    emitted += detok.flush()
    assert emitted == detok.text
    return emitted


@pytest.mark.parametrize("text, stop, expected", [
    ("The answer is 42. Observation: done", "Observation:", "The answer is 42. "),
    ("今天天气很好，我们去公园散步吧", "很好，我们", "今天天气"),
    ("robots 🤖🎉 party", "🤖🎉", "robots "),
    ("a\n\nUser: hi", "\n\nUser:", "a"),
])
def test_stop_string_across_tokens_is_cut_and_never_leaked(tok, text, stop, expected):
    ids = tok.encode(text)
    assert not any(stop in tok.decode([i]) for i in ids)  # the stop spans token boundaries
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    emitted = check_stream_is_prefix_of_final(detok, ids)
    assert emitted == detok.text == expected
    assert detok.finished_by_stop and detok.stop_reason == stop


def test_include_stop_str_in_output(tok):
    ids = tok.encode("The answer is 42. Observation: done")
    detok = IncrementalDetokenizer(tok, [], stop=["Observation:"], include_stop_str_in_output=True)
    emitted = check_stream_is_prefix_of_final(detok, ids)
    assert emitted == detok.text == "The answer is 42. Observation:"
    assert detok.stop_reason == "Observation:"


def test_earliest_stop_wins_and_later_tokens_are_ignored(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["world", "lo"])
    assert detok.add(tok.encode("hello world and more")) == "hel"
    assert detok.stop_reason == "lo"
    assert detok.add(tok.encode(" extra")) == "" and detok.text == "hel"
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, [], stop=["STOP"])
    emitted = detok.add(tok.encode("go ST"))
    assert emitted == "go " and detok.text == "go ST"
    emitted += detok.add(tok.encode("AY here"))
    assert emitted == "go STAY here" and not detok.finished_by_stop
    emitted += detok.add(tok.encode(" S"))
    assert emitted == "go STAY here "
    assert detok.flush() == "S" and not detok.finished_by_stop


def test_stop_string_completed_by_special_token_when_not_skipped(tok):
    ids = tok.encode("done<|im_end|>trailing")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert check_stream_is_prefix_of_final(detok, ids) == "done"
    assert detok.stop_reason == "<|im_end|>"


@pytest.mark.parametrize("seed", range(3))
def test_random_streams_with_stops_match_cut_full_decode(tok, seed):
    rng = random.Random(seed)
    ids = tok.encode(random_text(rng, 60))
    full = tok.decode(ids)
    stops = [" 日本語の", "世界 🤖", "é Ε", "xyz-never"]
    detok = IncrementalDetokenizer(tok, [], stop=stops)
    emitted = "".join(stream(detok, ids, rng))
    hits = [(full.find(s), s) for s in stops if s in full]
    index, stop = min(hits) if hits else (len(full), None)
    assert emitted == detok.text == full[:index]
    assert detok.stop_reason == stop


@pytest.mark.parametrize("seed", range(3))
def test_long_text_kept_in_pieces_reads_and_cuts_as_one_string(tok, seed):
    """Hundreds of tokens, the text never read meanwhile (as a DELTA stream): its pieces
    are joined every 64, and tails, held-back text and a late stop string come out as if
    the text were one string."""
    rng = random.Random(seed)
    ids = tok.encode(random_text(rng, 400))
    full = tok.decode(ids)
    start = len(full) * 3 // 4  # a stop string that first occurs there
    stop = next(full[start:start + n] for n in range(3, 40)
                if full.find(full[start:start + n]) == start)
    assert len(ids) > 200
    detok = IncrementalDetokenizer(tok, [], stop=["xyz-never", stop])
    checker = IncrementalDetokenizer(tok, [], stop=["xyz-never", stop])
    for i in ids:
        detok.append(i)
        checker.append(i)
        assert checker.text.endswith(checker.text_since(checker.num_chars - 1))  # joined
        assert detok.num_chars == checker.num_chars
        assert detok.held_back() == checker.held_back()
        k = rng.randrange(detok.num_chars + 1)
        assert detok.text_since(k) == checker.text[k:]
    assert detok.text == checker.text == full[:full.index(stop)]
    assert detok.stop_reason == stop
