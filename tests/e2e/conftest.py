"""The engine tests' checkpoint with the real Qwen3 tokenizer and the server tests' dummy-weight
one, shared by the end-to-end tests."""

from tests.engine.conftest import compile_cache, tokenizer_ckpt  # noqa: F401 (fixtures)
from tests.helpers.fake_openai import fake_server  # noqa: F401 (fixture)
from tests.server.conftest import tiny_model_dir  # noqa: F401 (fixture)
