"""`qwen-jax bench serve --plot`: the run's timeline and per-request detail, and the
figure for one or several result files."""

import json
import sys

import numpy as np
import pytest

from serving.bench.plot import load_results, throughput_series
from serving.cli.main import main
from test_bench import OUTPUT_LEN

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _run(tmp_path, url, name, *extra) -> tuple[dict, str]:
    out, png = tmp_path / f"{name}.json", tmp_path / f"{name}.png"
    rc = main(["bench", "serve", "--base-url", url, "--num-prompts", "8",
               "--random-input-len", "12", "--random-output-len", str(OUTPUT_LEN),
               "--max-concurrency", "3", "--metrics-interval", "0.01", "--result-json", str(out),
               "--plot", str(png), *extra])
    assert rc == 0
    return json.loads(out.read_text()), str(png)


def test_plot_of_a_run_with_the_servers_gauges(tmp_path, fake_server):
    url, state = fake_server
    state.metrics = True
    report, png = _run(tmp_path, url, "gauges")
    assert open(png, "rb").read(8) == PNG_MAGIC
    timeline = report["timeline"]
    assert len(timeline["t"]) == len(timeline["running"]) == len(timeline["in_flight"]) > 2
    assert 1 <= max(timeline["running"]) <= 3 and max(timeline["in_flight"]) <= 3
    starts = report["start_times"]
    assert len(starts) == 8 and 0 <= min(starts) and max(starts) < report["duration"]
    # Spreading each request's tokens over its chunks keeps every token.
    centres, rate = throughput_series(report, 0.05)
    assert rate.sum() * 0.05 == pytest.approx(report["total_output_tokens"])


def test_without_server_gauges_the_client_side_is_kept(tmp_path, fake_server):
    url, _ = fake_server
    report, _ = _run(tmp_path, url, "client")
    assert report["timeline"]["running"] == [] and max(report["timeline"]["in_flight"]) >= 1


def test_several_result_files_side_by_side(tmp_path, fake_server, capsys):
    url, state = fake_server
    first, _ = _run(tmp_path, url, "a")
    state.metrics = True
    _run(tmp_path, url, "b")
    png = tmp_path / "both.png"
    rc = main(["bench", "serve", "--plot", str(png), "--plot-results", str(tmp_path / "a.json"),
               str(tmp_path / "b.json"), "--plot-labels", "ours", "theirs"])
    assert rc == 0 and png.read_bytes()[:8] == PNG_MAGIC
    assert f"plot: {png}" in capsys.readouterr().out
    runs = load_results([str(tmp_path / "a.json")], ["x"])
    assert runs[0][0] == "x" and np.allclose(runs[0][1]["ttfts"], first["ttfts"])


def test_plot_inputs_are_checked(tmp_path, fake_server, monkeypatch, capsys):
    url, _ = fake_server
    plain = tmp_path / "plain.json"
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "2",
                 "--result-json", str(plain)]) == 0
    assert main(["bench", "serve", "--plot", str(tmp_path / "x.png"),
                 "--plot-results", str(plain)]) == 2
    assert "no per-request detail" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 labels for 1 files"):
        load_results([str(plain)], ["a", "b"])
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "serve", "--base-url", url, "--num-prompts", "2",
                 "--random-input-len", "4", "--random-output-len", "2",
                 "--plot", str(tmp_path / "y.png")]) == 2
    assert "pip install 'qwen-jax[plot]'" in capsys.readouterr().err
