"""`GET /tokenizer_info` (vLLM's, behind the same option, `--enable-tokenizer-info-endpoint`:
it shows the chat template): the checkpoint's tokenizer configuration, as clients that
tokenize on their side read it."""

from __future__ import annotations

from aiohttp import web

# what vLLM leaves out: paths on the server's disk
_LEFT_OUT = ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")


async def tokenizer_info(server, request: web.Request) -> web.Response:
    tokenizer = server._need_tokenizer()
    config = {k: v for k, v in tokenizer.config.items() if k not in _LEFT_OUT}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    config["chat_template"] = tokenizer.chat_template
    config["eos_token_ids"] = list(tokenizer.eos_token_ids)
    config["vocab_size"] = tokenizer.backend.get_vocab_size()
    return web.json_response(config)


__all__ = ["tokenizer_info"]
