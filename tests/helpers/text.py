"""Random text that stresses byte-level BPE: characters split across tokens."""

# Text whose Qwen3 tokens split characters across tokens (🤖 is three tokens).
MIXED_PIECES = ["Hello", " world", ",", " 你好", "世界", " 🤖", "🎉", " naïve", " café",
                " 👩‍💻", " Ελληνικά", " 日本語のテキスト", " ∑x²", "\n", "  ", " the end",
                "🇫🇷"]


def random_text(rng, num_pieces=40):
    return "".join(rng.choice(MIXED_PIECES) for _ in range(num_pieces))
