"""The real Qwen3 tokenizer, shared by the tokenizer and detokenizer tests."""

import pytest

from qwen_jax.tokenizer import Tokenizer
from tests.helpers.fixtures import QWEN3_TOKENIZER


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(QWEN3_TOKENIZER)
