"""Streaming detokenization of a request's output tokens, with stop strings.

Host-side text only (no jax): turns each sampled token into the text that became stable.
"""

from __future__ import annotations

from codecs import utf_8_decode as _utf_8_decode
from collections.abc import Iterable, Sequence

from qwen_jax.tokenizer import Tokenizer

try:  # newer tokenizers releases: the same prefix/read-offset decoding, one Rust call per token
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: two decode calls per token
    _DecodeStream = None  # type: ignore[assignment, misc]

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the output so the first output token is detokenized in context.
_PROMPT_CONTEXT_TOKENS = 5
# New text is kept as pieces, joined onto the text every this many: appending to a long
# str copies all of it, which per token made a long reply's text cost O(length) a step.
_JOIN_EVERY = 64


class IncrementalDetokenizer:
    """Turns a stream of output token ids into stable text deltas, applying stop strings.

    Where each token stands for fixed bytes (a ByteLevel decoder: `Tokenizer.token_bytes`),
    a token's text is its bytes through an incremental UTF-8 decoder, which holds back a
    character split across tokens until it is complete: one dict-free lookup and one C call
    per token. Otherwise it decodes a short window of tokens twice — without and with the
    newest token — and emits the difference once it no longer ends in U+FFFD (vLLM's
    prefix/read offsets; one call into the tokenizers library's DecodeStream where it has
    one); that window starts in the prompt so the first output token is decoded in context.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Iterable[str] = (),
                 include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        # window = token ids from the prefix offset on; window[:read] is already in the text.
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._text = ""  # the text before `_pieces`; see the `text` property
        self._pieces: list[str] = []
        self.num_chars = 0  # len(text)
        # the text's last characters that a stop string could start in (with stops only)
        self._keep = max(map(len, self._stops), default=1) - 1
        self._tail = ""
        self._num_emitted = 0
        self.stop_reason: str | None = None
        self._stream = None
        token_bytes = getattr(tokenizer, "token_bytes", None)
        self._bytes = None if token_bytes is None else token_bytes(skip_special_tokens)
        self._undecoded = b""  # the start of a character split across tokens
        if self._bytes is not None:
            return
        backend = getattr(tokenizer, "backend", None)
        if _DecodeStream is not None and backend is not None:
            try:
                self._stream = _DecodeStream(ids=self._window,
                                            skip_special_tokens=skip_special_tokens)
                self._backend = backend
            except TypeError:  # a release without the `ids` (prompt context) argument
                self._stream = None

    @property
    def text(self) -> str:
        """All output text so far, cut at the stop string once one matched."""
        if self._pieces:
            self._text += "".join(self._pieces)
            self._pieces.clear()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self._text, self.num_chars = value, len(value)
        self._pieces.clear()
        self._tail = value[-self._keep:] if self._keep else ""

    def text_since(self, start: int) -> str:
        """text[start:], from the newest pieces: a tail costs its own length, not the
        text's (what stop checks and DELTA outputs read per token)."""
        size = self.num_chars - start
        if size <= 0:
            return ""
        pieces = self._pieces
        if pieces and size <= len(pieces[-1]):  # within the newest piece: mostly
            return pieces[-1][len(pieces[-1]) - size:]
        parts, need = [], size
        for piece in reversed(pieces):
            parts.append(piece)
            need -= len(piece)
            if need <= 0:
                break
        else:
            parts.append(self._text[len(self._text) - need:])
        tail = "".join(reversed(parts))
        return tail[len(tail) - size:]

    def _extend(self, chunk: str) -> None:
        """Appends `chunk` to the text, then cuts the text at a stop string it completes."""
        num_chars = self.num_chars
        pieces = self._pieces
        pieces.append(chunk)
        self.num_chars = num_chars + len(chunk)
        if len(pieces) >= _JOIN_EVERY:
            self._text += "".join(pieces)
            pieces.clear()
        if self._stops:
            window = self._tail + chunk  # text[start:], where a new stop string could start
            start = self.num_chars - len(window)
            keep = self._keep
            self._tail = window[-keep:] if keep else ""
            self._check_stop(window, start)

    @property
    def finished_by_stop(self) -> bool:
        return self.stop_reason is not None

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends output tokens; returns the text that became stable. Ignored after a stop."""
        for token_id in token_ids:
            self.append(token_id)
        return self.take_delta(final=self.finished_by_stop)

    def append(self, token_id: int) -> None:
        """`add` of one token without computing the delta (what the engine needs per step:
        the text and whether a stop string ended it). Runs per token of every request."""
        if self.stop_reason is not None:
            return
        table = self._bytes
        chunk: str | None
        if table is not None:  # codecs' incremental UTF-8 decoder, without its Python layer
            data = table[token_id] if token_id < len(table) else b""
            if self._undecoded:
                data = self._undecoded + data
            chunk, used = _utf_8_decode(data, "replace", False)
            self._undecoded = data[used:]
        elif self._stream is None:
            chunk = self._python_step(token_id)
        else:
            try:
                chunk = self._stream.step(self._backend, token_id)
            except Exception:  # its consistency check failed: go on with the Python path
                self._stream = None
                chunk = self._python_step(token_id)
            else:
                self._window.append(token_id)
                if chunk is None:
                    return
                del self._window[:self._read]
                self._read = len(self._window)
        if chunk:
            self._extend(chunk)

    def flush(self) -> str:
        """Call once the request ends for any reason but a stop string: returns the held-back tail
        (a possible stop-string prefix, or an incomplete UTF-8 sequence as U+FFFD)."""
        self.finish()
        return self.take_delta(final=True)

    def finish(self) -> None:
        """`flush` without taking the delta: the held-back tail goes into the text."""
        if self._bytes is not None:
            tail = "" if self.finished_by_stop else self._undecoded.decode("utf-8", "replace")
            self._undecoded = b""
            if tail:  # an incomplete character, as U+FFFD
                self._extend(tail)
        elif not self.finished_by_stop and self._read < len(self._window):
            prefix_text = self._decode(self._window[:self._read])
            self._extend(self._decode(self._window)[len(prefix_text):])
            self._window, self._read = [], 0
        self._stream = None  # the mirror is reset; tokens after a flush go the Python way

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _python_step(self, token_id: int) -> str:
        """The text `token_id` makes stable, by decoding the window twice."""
        self._window.append(token_id)
        prefix_text = self._decode(self._window[:self._read])
        new_text = self._decode(self._window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing visible yet, or an incomplete multi-byte character
        del self._window[:self._read]
        self._read = len(self._window)
        return new_text[len(prefix_text):]

    def _check_stop(self, window: str, start: int) -> None:
        """Finds the earliest stop string in `window` (the text from `start` on) and cuts
        the text there."""
        found = [(i, s) for s in self._stops if (i := window.find(s)) >= 0]
        if not found:
            return
        index, stop = min(found, key=lambda hit: hit[0])
        self.stop_reason = stop
        self.text = self.text[:start + index + (len(stop) if self._include_stop else 0)]

    def held_back(self) -> int:
        """Length of the longest text suffix that could begin a stop string (text a
        delta keeps back until a later token settles it). Runs per token of a DELTA
        stream: a find of each stop's first character in the text's tail, mostly."""
        if self._include_stop or not self._stops:  # a stop string would stay, or none
            return 0
        text, longest = self._tail, 0  # a suffix that begins a stop is shorter than it
        size = len(text)
        for stop in self._stops:
            # a suffix that begins `stop` starts with its first character, within its reach
            i = text.find(stop[0], max(size - len(stop) + 1, 0))
            while i != -1 and size - i > longest:
                if stop.startswith(text[i:]):
                    longest = size - i
                    break
                i = text.find(stop[0], i + 1)
        return longest

    def take_delta(self, *, final: bool) -> str:
        """The text since the last delta taken; while not `final`, but a tail that may
        begin a stop string (held back until a later token settles it)."""
        end = self.num_chars if final else self.num_chars - self.held_back()
        end = max(end, self._num_emitted)
        delta = self.text_since(self._num_emitted)[:end - self._num_emitted]
        self._num_emitted = end
        return delta
