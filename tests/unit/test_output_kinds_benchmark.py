"""benchmarks/output_kinds.py keeps timing what it says: a CUMULATIVE output that holds
the whole output, a DELTA one that holds the new token."""

from benchmarks import output_kinds
from qwen_jax.tokenizer import Tokenizer
from qwen_jax.weights import DEFAULT_MODEL_DIR


def test_the_timed_outputs_hold_the_whole_output_or_the_new_token():
    tokenizer = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    ids = tokenizer.encode(output_kinds.TEXT)
    for delta, expected in ((False, 201), (True, 1)):
        processor, seq, parent, build = output_kinds.stream(tokenizer, ids, 200, delta)
        processor.append(seq, ids[0], None, 0)
        (completion,) = build(parent, seq).outputs
        assert len(completion.token_ids) == expected


def test_report_has_both_kinds_at_every_length():
    report = output_kinds.main(["--lengths", "10", "300", "--steps", "20", "--repeats", "1"])
    assert list(report["lengths"]) == [10, 300]
    for entry in report["lengths"].values():
        assert set(entry["us_per_output"]) == {"cumulative", "delta"}
        assert all(v > 0 for v in entry["us_per_output"].values())
