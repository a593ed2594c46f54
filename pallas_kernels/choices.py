"""Per-shape kernel choices: which implementation of an op runs at which size, as the
device probe measured them (`benchmarks/device_probe.py` writes `kernel_table.json`;
`qwen-jax serve --kernel-table FILE` reads it). Without a table every op runs the
model's `impl` ("pallas": the Triton kernels).

The size of an op is what its cost grows with and what a compiled step fixes: the
grouped matmul's rows (tokens x top-k), attention's query tokens. A size the table has
no entry for takes the entry of the smallest measured size above it (the largest, past
them all): step buckets sit between the probe's sizes.

    {"grouped_matmul": {"64": "pallas", "16384": "mosaic"},
     "ragged_paged_attention": {"8": "pallas", "2048": "mosaic"}}
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path

from pallas_kernels.quantized import QuantizedWeight

# The implementations the table may name, per op.
CANDIDATES = {"grouped_matmul": ("pallas", "mosaic", "xla"),
              "ragged_paged_attention": ("pallas", "mosaic")}


@dataclasses.dataclass(frozen=True)
class KernelTable:
    """op -> ((size, impl), ...) sorted by size. Frozen and hashable: it is part of the
    model's static runtime."""

    entries: tuple[tuple[str, tuple[tuple[int, str], ...]], ...] = ()

    @classmethod
    def from_dict(cls, table: dict, source: str = "kernel table") -> KernelTable:
        if not isinstance(table, dict):
            raise ValueError(f"{source}: expected a JSON object of ops, got "
                             f"{type(table).__name__}")
        entries = []
        for op, sizes in sorted(table.items()):
            if op not in CANDIDATES:
                raise ValueError(f"{source}: op {op!r} is not one of {sorted(CANDIDATES)}")
            if not isinstance(sizes, dict) or not sizes:
                raise ValueError(f"{source}: {op} must map sizes to implementations, got "
                                 f"{sizes!r}")
            picks = []
            for size, impl in sizes.items():
                if not str(size).isdigit() or int(size) < 1:
                    raise ValueError(f"{source}: {op} size {size!r} is not a positive int")
                if impl not in CANDIDATES[op]:
                    raise ValueError(f"{source}: {op}[{size}] is {impl!r}, expected one of "
                                     f"{CANDIDATES[op]}")
                picks.append((int(size), impl))
            entries.append((op, tuple(sorted(picks))))
        return cls(tuple(entries))

    @classmethod
    def load(cls, path: str | Path) -> KernelTable:
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"kernel_table: {str(path)!r} is not a file")
        try:
            table = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"kernel_table {str(path)!r}: invalid JSON: {exc}") from None
        return cls.from_dict(table, f"kernel_table {str(path)!r}")

    def to_dict(self) -> dict:
        return {op: {str(size): impl for size, impl in picks} for op, picks in self.entries}

    def pick(self, op: str, size: int, default: str) -> str:
        """The implementation of `op` at `size`; `default` where the table has no op."""
        picks = dict(self.entries).get(op)
        if not picks:
            return default
        i = bisect.bisect_left([s for s, _ in picks], size)
        return picks[min(i, len(picks) - 1)][1]


def fastest(rows: Iterable[dict]) -> KernelTable:
    """The table of the fastest implementation per (op, size) among timing rows
    {"op", "size", "impl", "ms"}; rows with an "error", or of quantised weights (a
    "format" other than bf16: only the Triton kernel reads those), are skipped."""
    best: dict[tuple[str, int], tuple[float, str]] = {}
    for row in rows:
        if "error" in row or row.get("op") not in CANDIDATES:
            continue
        if row.get("format", "bf16") != "bf16":
            continue
        if row["impl"] not in CANDIDATES[row["op"]]:
            continue
        key = (row["op"], int(row["size"]))
        if key not in best or row["ms"] < best[key][0]:
            best[key] = (row["ms"], row["impl"])
    table: dict[str, dict[str, str]] = {}
    for (op, size), (_, impl) in best.items():
        table.setdefault(op, {})[str(size)] = impl
    return KernelTable.from_dict(table)


def _grouped_matmul_rows(lhs, rhs, group_sizes=None, *, plan=None, lhs_rows=None, **_) -> int:
    if plan is not None:
        return plan.num_rows
    return (lhs if lhs_rows is None else lhs_rows).shape[0]


def _candidates(op: str, impl: str):
    """The entry points of `op` in implementation `impl` (imported when first asked)."""
    if op == "grouped_matmul":
        from pallas_kernels.grouped_matmul import grouped_matmul
        if impl == "pallas":
            return grouped_matmul
        if impl == "mosaic":
            from pallas_kernels.grouped_matmul.mosaic import grouped_matmul_mosaic
            return grouped_matmul_mosaic
        from pallas_kernels.grouped_matmul.xla import grouped_matmul_xla
        return grouped_matmul_xla
    from pallas_kernels.ragged_paged_attention import plan_attention, ragged_paged_attention
    if impl == "pallas":
        return plan_attention, ragged_paged_attention
    from pallas_kernels.ragged_paged_attention.mosaic import (
        plan_attention_mosaic,
        ragged_paged_attention_mosaic,
    )
    return plan_attention_mosaic, ragged_paged_attention_mosaic


def chosen(kernels, table: KernelTable):
    """`kernels` (an Ops) whose grouped matmul and attention run the table's pick at each
    call's size: a Python choice at trace time, so each compiled step holds one kernel
    per call. Attention's plan and kernel are picked by the same size (query tokens), so
    a step never mixes one implementation's plan with the other's kernel."""
    default = kernels.impl

    def grouped_matmul(*args, **kwargs):
        impl = table.pick("grouped_matmul", _grouped_matmul_rows(*args, **kwargs), default)
        if impl == "xla" and isinstance(args[1], QuantizedWeight):
            impl = default  # ragged_dot has no quantised operands; the kernels do
        return _candidates("grouped_matmul", impl)(*args, **kwargs)

    def plan_attention(*args, num_tokens, **kwargs):
        impl = table.pick("ragged_paged_attention", num_tokens, default)
        return _candidates("ragged_paged_attention", impl)[0](*args, num_tokens=num_tokens,
                                                              **kwargs)

    def ragged_paged_attention(q, *args, **kwargs):
        impl = table.pick("ragged_paged_attention", q.shape[0], default)
        return _candidates("ragged_paged_attention", impl)[1](q, *args, **kwargs)

    return dataclasses.replace(kernels, grouped_matmul=grouped_matmul,
                               plan_attention=plan_attention,
                               ragged_paged_attention=ragged_paged_attention)
