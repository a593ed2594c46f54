"""benchmarks/engine_overlap.py --server keeps measuring what it says: streams served with
the engine on a thread and in its own process (a fake device put in by the engine hook),
every stream read to its end, the step period taken while all of them decode."""

from benchmarks import engine_overlap


def test_server_mode_serves_every_stream_with_both_engine_kinds(compile_cache):
    report = engine_overlap.main(["--server", "--seqs", "8", "--device-ms", "0", "--steps",
                                  "4", "--rounds", "1", "--compilation-cache-dir",
                                  compile_cache])
    cell = report["server"]["8 seqs, d=0 ms"]
    assert set(cell) == {"thread", "process"}
    for summary in cell.values():
        (step_ms,) = summary["step_ms"]
        assert step_ms > 0 and summary["efficiency"] == [None]  # no device time to use
        # 8 streams of steps + 45 tokens, read as one output each at most
        assert 8 <= summary["outputs_read"] <= 8 * (4 + 45)
