"""Files shipped with the tests (see each folder's NOTICE.md for origin and license)."""

from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# The real Qwen3 tokenizer.json and tokenizer_config.json (Apache-2.0).
QWEN3_TOKENIZER = FIXTURES / "qwen3-tokenizer"
