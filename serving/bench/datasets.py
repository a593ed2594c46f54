"""Benchmark prompts: `random`, `shared-prefix` and a JSONL file.

With a tokenizer, random text is decoded from random token ids and re-encoded until it
has exactly the requested number of tokens; without one it is random common words and
`prompt_len` is an estimate (the server's usage.prompt_tokens replaces it when sent).
With `token_ids`, prompts are lists of random token ids (exact lengths, no tokenizer:
for servers of dummy-weight presets, which have none).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

WORDS = (
    "the of and to in is was for on are with as his they be at one have this from or had "
    "by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most "
    "people my over know water than call first who may down side been now find any new work "
    "part take get place made live where after back little only round man year came show "
    "every good me give our under name very through just form sentence great think say help "
    "low line differ turn cause much mean before move right boy old too same tell does set "
    "three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father").split()


@dataclasses.dataclass
class BenchRequest:
    prompt: str | list[int] | None  # completions text or ids; for chat the user message
    prompt_len: int  # tokens (an estimate without a tokenizer)
    output_len: int
    system: str | list[int] | None = None  # shared prefix: chat system message / prefix
    messages: list[dict] | None = None  # a JSONL line's own conversation


class TextSource:
    """Random text of a given token length, reproducible from the generator's seed."""

    def __init__(self, tokenizer, rng: np.random.Generator, *, token_ids: bool = False,
                 vocab_size: int = 10000):
        self.tokenizer, self.rng, self.token_ids = tokenizer, rng, token_ids
        self.num_ids = vocab_size
        if tokenizer is not None:  # draw from the ordinary vocabulary, no special tokens
            self.num_ids = tokenizer.backend.get_vocab_size(with_added_tokens=False)

    def text(self, num_tokens: int) -> tuple[str | list[int], int]:
        if self.token_ids:
            return self.rng.integers(0, self.num_ids, size=max(num_tokens, 0)).tolist(), \
                max(num_tokens, 0)
        if num_tokens <= 0:
            return "", 0
        if self.tokenizer is None:
            return " ".join(self.rng.choice(WORDS, size=num_tokens)), num_tokens
        ids = self.rng.integers(0, self.num_ids, size=num_tokens).tolist()
        for _ in range(10):  # decode/encode does not round-trip: converge on the length
            text = self.tokenizer.decode(ids)
            ids = self.tokenizer.encode(text)
            if len(ids) == num_tokens:
                break
            if len(ids) > num_tokens:
                ids = ids[:num_tokens]
            else:
                ids += self.rng.integers(0, self.num_ids, size=num_tokens - len(ids)).tolist()
        text = self.tokenizer.decode(ids)
        return text, len(self.tokenizer.encode(text))

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text)) if self.tokenizer else len(text.split())


def _lengths(rng, mean: int, range_ratio: float, n: int) -> list[int]:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return rng.integers(max(low, 1), max(high, 1) + 1, size=n).tolist()


def random_requests(source: TextSource, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = source.rng
    inputs = _lengths(rng, input_len, range_ratio, num_prompts)
    outputs = _lengths(rng, output_len, range_ratio, num_prompts)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        text, n = source.text(n_in)
        requests.append(BenchRequest(text, n, n_out))
    return requests


def shared_prefix_requests(source: TextSource, num_prompts: int, num_groups: int,
                           prefix_len: int, suffix_len: int, output_len: int
                           ) -> list[BenchRequest]:
    """`num_groups` long prefixes, each shared by ~num_prompts/num_groups prompts, shuffled."""
    if num_groups < 1:
        raise ValueError(f"--num-prefix-groups must be >= 1, got {num_groups}")
    prefixes = [source.text(prefix_len) for _ in range(num_groups)]
    requests = []
    for i in range(num_prompts):
        prefix, n_prefix = prefixes[i % num_groups]
        suffix, n_suffix = source.text(suffix_len)
        requests.append(BenchRequest(suffix, n_prefix + n_suffix, output_len, system=prefix))
    order = source.rng.permutation(len(requests))
    return [requests[i] for i in order]


def jsonl_requests(source: TextSource, path: str, num_prompts: int, output_len: int
                   ) -> list[BenchRequest]:
    """Lines {"prompt": text} or {"messages": [...]}, optional "output_len"/"max_tokens"."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError as e:
                raise ValueError(f"{path}:{line_no}: invalid JSON: {e}") from None
            n_out = int(obj.get("output_len") or obj.get("max_tokens") or output_len)
            if "messages" in obj:
                text = " ".join(str(m.get("content", "")) for m in obj["messages"])
                requests.append(BenchRequest(None, source.count(text), n_out,
                                             messages=obj["messages"]))
            elif isinstance(obj.get("prompt"), str):
                requests.append(BenchRequest(obj["prompt"], source.count(obj["prompt"]), n_out))
            else:
                raise ValueError(f"{path}:{line_no}: needs a 'prompt' string or 'messages'")
            if len(requests) == num_prompts:
                break
    if not requests:
        raise ValueError(f"--dataset-path {path} has no prompts")
    return requests


def load_tokenizer(path: str | None):
    if not path:
        return None
    from qwen_jax.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(Path(path))
    if tokenizer is None:
        raise ValueError(f"--tokenizer {path}: no tokenizer files there")
    return tokenizer


def build_requests(args, tokenizer=None) -> list[BenchRequest]:
    if args.token_ids and (args.dataset == "jsonl" or args.endpoint != "/v1/completions"):
        raise ValueError("--token-ids needs --endpoint /v1/completions and a random or "
                         "shared-prefix dataset")
    source = TextSource(tokenizer, np.random.default_rng(args.seed), token_ids=args.token_ids,
                        vocab_size=args.random_vocab_size)
    if args.dataset == "random":
        return random_requests(source, args.num_prompts, args.random_input_len,
                               args.random_output_len, args.random_range_ratio)
    if args.dataset == "shared-prefix":
        return shared_prefix_requests(source, args.num_prompts, args.num_prefix_groups,
                                      args.shared_prefix_len, args.suffix_len,
                                      args.random_output_len)
    if not args.dataset_path:
        raise ValueError("--dataset jsonl needs --dataset-path")
    return jsonl_requests(source, args.dataset_path, args.num_prompts, args.random_output_len)
