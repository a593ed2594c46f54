"""benchmarks/stream_chunks.py keeps working as the server's streaming code changes."""

from benchmarks import stream_chunks


def test_stream_chunks_times_every_output_of_both_kinds():
    report = stream_chunks.main(["--tokens", "4", "--repeats", "2"])
    assert report["tokens"] == 4
    for kind in ("chat", "completions"):
        timing = report["us_per_output"][kind]
        assert 0 < timing["min"] <= timing["median"]
        assert timing["chunks_per_pass"] == 4  # one SSE chunk per output: what it times
