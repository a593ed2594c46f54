"""One tiny MoE engine (real Qwen3 tokenizer, dummy weights: no torch needed) shared by the
server tests, and a helper that runs the aiohttp app on a loopback port in its own thread."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from pathlib import Path

import pytest

from tests.helpers.fixtures import QWEN3_TOKENIZER

ENGINE_ARGS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
                   token_buckets=[8, 64], seq_buckets=[4, 8], show_progress=False,
                   load_format="dummy")
TINY_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 40,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8, "max_position_embeddings": 256, "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6, "eos_token_id": 151645, "bos_token_id": 151643,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def write_tiny_checkpoint(path: Path) -> Path:
    """config.json + the real Qwen3 tokenizer files; weights come from load_format=dummy."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_TOKENIZER / name, path / name)
    return path


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("xla-cache"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "tiny")


@pytest.fixture(scope="session")
def shared_llm(tiny_model_dir, compile_cache):
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(tiny_model_dir), compilation_cache_dir=compile_cache, **ENGINE_ARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def long_llm(tmp_path_factory, compile_cache):
    """A random model like `shared_llm`'s with room for a tools header (about 220 prompt
    tokens) and the calls after it."""
    from serving.engine.async_llm import AsyncLLM
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("server-ckpt") / "long")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    llm = AsyncLLM(str(path), compilation_cache_dir=compile_cache,
                   **{**ENGINE_ARGS, "max_model_len": 512, "max_num_batched_tokens": 256,
                      "token_buckets": [8, 256]})
    yield llm
    llm.shutdown()


class ServerThread:
    """The app served on 127.0.0.1:<free port> by an event loop in a background thread."""

    def __init__(self, llm, **server_kwargs):
        self.llm = llm
        self.server_kwargs = server_kwargs
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.port: int | None = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._start())
        except BaseException as exc:  # surfaced to the test by start()
            self.error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        from aiohttp import web

        from serving.entrypoints.openai.api_server import build_app
        from serving.entrypoints.openai.config import ServerConfig
        app = build_app(self.llm, ServerConfig(**self.server_kwargs))
        self.app = app
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait(60)
        if self.error is not None:
            raise self.error
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        fut = asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop)
        with contextlib.suppress(Exception):
            fut.result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


# The embedded tiny model (qwen_jax/assets) as the end-to-end tests serve it
EMBEDDED_MODEL = "tiny-qwen3-moe"
EMBEDDED_ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512,
                       token_buckets=[8, 128], seq_buckets=[4], show_progress=False)


@contextlib.contextmanager
def serve_embedded_model(compilation_cache_dir, **server_kwargs):
    """The embedded model's engine (AsyncLLM) behind a ServerThread, shut down after."""
    from qwen_jax.weights import DEFAULT_MODEL_DIR
    from serving.engine.async_llm import AsyncLLM
    llm = AsyncLLM(str(DEFAULT_MODEL_DIR), compilation_cache_dir=str(compilation_cache_dir),
                   **EMBEDDED_ENGINE)
    srv = ServerThread(llm, served_model_name=EMBEDDED_MODEL, **server_kwargs).start()
    try:
        yield srv
    finally:
        srv.stop()
        llm.shutdown()


@pytest.fixture(scope="module")
def server(shared_llm):
    srv = ServerThread(shared_llm, served_model_name="tiny").start()
    yield srv
    srv.stop()


async def wait_idle(llm, timeout: float = 10.0) -> dict:
    """Poll the engine snapshot until nothing runs or waits and every page is free."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        stats = llm.stats()
        if (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and stats["num_used_pages"] == 0) or loop.time() > deadline:
            return stats
        await asyncio.sleep(0.05)
