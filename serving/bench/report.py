"""Per-request results -> a run's report in vLLM `bench serve`'s metric names. Pure Python +
numpy.

TTFT: request sent -> first streamed chunk with a choice. ITL: the gaps between
successive chunks. E2EL: request sent -> last chunk. TPOT: (E2EL - TTFT) / (output
tokens - 1), only for outputs of more than one token. Goodput: completed requests that
meet every SLO given, per second of the run (a request with one output token counts
TPOT 0 against the TPOT SLO, as vLLM does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = (("ttft", "Time to First Token"),
                   ("tpot", "Time per Output Token (excl. 1st token)"),
                   ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))


@dataclasses.dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # the server's usage.prompt_tokens when it sends one
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0  # end to end, seconds
    start: float = 0.0  # when it was sent, seconds into the run
    generated_text: str = ""
    error: str = ""


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput entries look like NAME:MS with NAME in {SLO_METRICS}, "
                             f"got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} must be a number of ms, got {value!r}") from None
        if ms < 0:
            raise ValueError(f"--goodput {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def _summary(name: str, values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s or [0.0], dtype=np.float64) * 1000.0
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _is_good(ttft: float, tpot: float, e2el: float, slos_ms: dict[str, float]) -> bool:
    values = {"ttft": ttft, "tpot": tpot, "e2el": e2el}
    return all(values[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def compute_metrics(results: list[RequestResult], duration_s: float, *,
                    percentiles: Sequence[float] = (90.0, 99.0),
                    slos_ms: dict[str, float] | None = None) -> dict:
    """The report of one run; `percentiles` adds p<P>_<metric>_ms for each."""
    ttfts, tpots, itls, e2els = [], [], [], []
    total_input = total_output = completed = good = 0
    for r in results:
        if not r.success:
            continue
        completed += 1
        total_input += r.prompt_len
        total_output += r.output_tokens
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            tpots.append(tpot)
        ttfts.append(r.ttft)
        itls.extend(r.itl)
        e2els.append(r.latency)
        if slos_ms and _is_good(r.ttft, tpot, r.latency, slos_ms):
            good += 1
    report = {
        "duration": duration_s, "completed": completed, "failed": len(results) - completed,
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": completed / duration_s,
        "request_goodput": good / duration_s if slos_ms else None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        report.update(_summary(name, values, list(percentiles)))
    return report


def format_table(report: dict, percentiles: list[float], title: str = "Serving Benchmark Result"
                 ) -> str:
    """vLLM's printed summary: a two-column table."""
    def row(label, value, fmt="{:<10.2f}"):
        return "{:<40} ".format(label) + (fmt.format(value) if value is not None else "n/a")

    lines = ["{s:{c}^{n}}".format(s=f" {title} ", n=50, c="="),
             row("Successful requests:", report["completed"], "{:<10}"),
             row("Failed requests:", report["failed"], "{:<10}"),
             row("Benchmark duration (s):", report["duration"]),
             row("Total input tokens:", report["total_input_tokens"], "{:<10}"),
             row("Total generated tokens:", report["total_output_tokens"], "{:<10}"),
             row("Request throughput (req/s):", report["request_throughput"])]
    if report.get("request_goodput") is not None:
        lines.append(row("Request goodput (req/s):", report["request_goodput"]))
    lines += [row("Output token throughput (tok/s):", report["output_throughput"]),
              row("Total token throughput (tok/s):", report["total_token_throughput"])]
    for name, label in LATENCY_METRICS:
        short = name.upper()
        lines.append("{s:{c}^{n}}".format(s=label, n=50, c="-"))
        lines.append(row(f"Mean {short} (ms):", report[f"mean_{name}_ms"]))
        lines.append(row(f"Median {short} (ms):", report[f"median_{name}_ms"]))
        lines.append(row(f"Std {short} (ms):", report[f"std_{name}_ms"]))
        for p in percentiles:
            lines.append(row(f"P{p:g} {short} (ms):", report[f"p{p:g}_{name}_ms"]))
    if "spec_decode_num_drafts" in report:  # the server speculated during the run
        lines += ["{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
                  row("Acceptance rate (%):", 100 * report["spec_decode_acceptance_rate"]),
                  row("Acceptance length:", report["spec_decode_mean_acceptance_length"]),
                  row("Drafts:", report["spec_decode_num_drafts"], "{:<10}"),
                  row("Draft tokens:", report["spec_decode_num_draft_tokens"], "{:<10}"),
                  row("Accepted tokens:", report["spec_decode_num_accepted_tokens"], "{:<10}")]
    lines.append("=" * 50)
    return "\n".join(lines)
