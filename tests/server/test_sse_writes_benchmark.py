"""benchmarks/sse_writes.py keeps measuring what it says: streams served over real HTTP
from an engine process, the API process's CPU and writes per output token."""

from benchmarks import sse_writes


def test_streams_over_http_are_counted_per_output(compile_cache):
    report = sse_writes.main(["--seqs", "16", "--device-ms", "0", "--rounds", "1",
                              "--max-tokens", "24", "--compilation-cache-dir", compile_cache])
    cell = report["cells"]["16 seqs, 0 ms"]
    (run,) = cell["runs"]
    assert run["api_cpu_us_per_output"] > 0 and run["tokens_per_s"] > 0
    # one write per output at most (+ the role chunk, the finish and [DONE] per stream)
    assert 0 < run["writes_per_output"] <= 1 + 3 / 24
    assert cell["median_api_cpu_us_per_output"] == run["api_cpu_us_per_output"]
