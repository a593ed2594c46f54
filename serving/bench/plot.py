"""`qwen-jax bench serve --plot FILE.png`: one figure for one or several result files side
by side (our server vs another, two configs): the TTFT and ITL distributions (empirical
CDFs), output throughput over the run, and running / waiting requests over the run (the
server's /metrics gauges when it has them, else the client's requests in flight).

The result files need the per-request detail (`--save-detailed`, which `--plot` turns
on). matplotlib is an optional extra: `pip install 'qwen-jax[plot]'`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

NUM_BINS = 50  # throughput bins over the longest run, at least MIN_BIN_S wide
MIN_BIN_S = 0.05


def load_results(paths: Sequence[str], labels: Sequence[str] | None = None
                 ) -> list[tuple[str, dict]]:
    if labels and len(labels) != len(paths):
        raise ValueError(f"--plot-labels has {len(labels)} labels for {len(paths)} files")
    runs = []
    for i, path in enumerate(paths):
        report = json.loads(Path(path).read_text())
        missing = [k for k in ("ttfts", "itls", "start_times", "output_lens") if k not in report]
        if missing:
            raise ValueError(f"{path} has no per-request detail ({', '.join(missing)}): rerun "
                             "bench serve with --save-detailed or --plot")
        runs.append((labels[i] if labels else Path(path).stem, report))
    return runs


def _successes(report: dict) -> list[bool]:
    return report.get("successes") or [True] * len(report["ttfts"])


def _cdf(ax, values_s: list[float], label: str) -> None:
    ms = np.sort(np.asarray(values_s, dtype=np.float64)) * 1000.0
    if ms.size == 0:
        return
    line, = ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=label)
    ax.axvline(float(np.median(ms)), color=line.get_color(), linestyle=":", linewidth=1)


def token_times(report: dict) -> tuple[np.ndarray, np.ndarray]:
    """Each streamed chunk's time in the run and the output tokens it stands for (a
    request's tokens spread evenly over its chunks)."""
    times, weights = [], []
    for start, ttft, itl, n_out, ok in zip(report["start_times"], report["ttfts"],
                                           report["itls"], report["output_lens"],
                                           _successes(report)):
        if not ok or not n_out:
            continue
        chunk_times = start + ttft + np.concatenate([[0.0], np.cumsum(itl)])
        times.append(chunk_times)
        weights.append(np.full(chunk_times.size, n_out / chunk_times.size))
    if not times:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(times), np.concatenate(weights)


def bin_width(runs: list[tuple[str, dict]]) -> float:
    longest = max(float(r.get("duration") or 0.0) for _, r in runs)
    return max(MIN_BIN_S, float(f"{longest / NUM_BINS:.1g}"))


def throughput_series(report: dict, bin_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres, output tokens/s) over the run."""
    times, weights = token_times(report)
    end = max(float(report.get("duration") or 0.0), float(times.max()) if times.size else 0.0)
    edges = np.arange(0.0, end + bin_s, bin_s)
    if edges.size < 2:
        edges = np.array([0.0, bin_s])
    counts, _ = np.histogram(times, bins=edges, weights=weights)
    return (edges[:-1] + edges[1:]) / 2, counts / bin_s


def _queue_panel(ax, report: dict, color: str, label: str) -> None:
    timeline = report.get("timeline") or {}
    t = timeline.get("t") or []
    if timeline.get("running"):
        ax.plot(t, timeline["running"], color=color, label=f"{label} running",
                drawstyle="steps-post")
        ax.plot(t, timeline["waiting"], color=color, linestyle="--", label=f"{label} waiting",
                drawstyle="steps-post")
    elif timeline.get("in_flight"):
        ax.plot(t, timeline["in_flight"], color=color, label=f"{label} in flight (client)",
                drawstyle="steps-post")


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'qwen-jax[plot]'") from None
    return matplotlib


def plot_results(runs: list[tuple[str, dict]], out_path: str) -> str:
    require_matplotlib().use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, itl_ax), (tput_ax, queue_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bin_s = bin_width(runs)
    for i, (label, report) in enumerate(runs):
        color = colors[i % len(colors)]
        ok = _successes(report)
        _cdf(ttft_ax, [v for v, s in zip(report["ttfts"], ok) if s], label)
        _cdf(itl_ax, [v for gaps, s in zip(report["itls"], ok) if s for v in gaps], label)
        centres, rate = throughput_series(report, bin_s)
        tput_ax.plot(centres, rate, color=color, label=label, drawstyle="steps-mid")
        _queue_panel(queue_ax, report, color, label)
    for ax, title in ((ttft_ax, "TTFT (dotted: median)"), (itl_ax, "Inter-token latency")):
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests" if ax is ttft_ax
               else "fraction of gaps", xscale="log", ylim=(0, 1.02))
    tput_ax.set(title=f"Output throughput ({bin_s:g} s bins)", xlabel="s into the run",
                ylabel="tokens/s")
    queue_ax.set(title="Requests running / waiting", xlabel="s into the run",
                 ylabel="requests")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=90)
    plt.close(fig)
    return out_path
