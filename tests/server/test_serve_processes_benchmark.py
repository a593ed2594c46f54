"""benchmarks/serve_processes.py's --send-cost keeps timing what it says: the engine
process's step and send, outputs built as wire tuples against as RequestOutputs."""

from benchmarks import serve_processes


def test_send_cost_times_both_ways_of_building_outputs():
    report = serve_processes.main(["--send-cost", "--seqs", "8", "--rounds", "2"])
    cell = report[8]
    assert cell["seqs"] == 8 and set(cell["ms_per_step"]) == {"objects", "wire"}
    assert all(ms > 0 for ms in cell["ms_per_step"].values())
    assert cell["wire_over_objects"]["q1"] <= cell["wire_over_objects"]["q3"]
