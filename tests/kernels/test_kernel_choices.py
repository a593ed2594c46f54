"""The per-shape kernel table (pallas_kernels/choices.py): what it accepts, which
implementation it picks at a size, the table the probe's timings make, and that the
model's ops call the picked implementation at trace time."""

import json

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from pallas_kernels import choices
from pallas_kernels.choices import KernelTable, fastest
from pallas_kernels.quantized import quantize
from qwen_jax.layers import Runtime

TABLE = {"grouped_matmul": {"64": "pallas", "16384": "mosaic"},
         "ragged_paged_attention": {"8": "pallas", "2048": "mosaic"}}


@pytest.mark.parametrize("table, message", [
    ({"softmax": {"8": "pallas"}}, "op 'softmax' is not one of"),
    ({"grouped_matmul": {"8": "cutlass"}}, r"grouped_matmul\[8\] is 'cutlass', expected one of"),
    ({"grouped_matmul": {"zero": "pallas"}}, "size 'zero' is not a positive int"),
    ({"grouped_matmul": {}}, "grouped_matmul must map sizes to implementations"),
    ({"ragged_paged_attention": {"8": "xla"}}, r"\[8\] is 'xla'"),
    (["grouped_matmul"], "expected a JSON object of ops, got list"),
])
def test_a_bad_table_is_refused_with_the_field_and_value(table, message):
    with pytest.raises(ValueError, match=message):
        KernelTable.from_dict(table)


def test_a_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="kernel_table: .* is not a file"):
        KernelTable.load(tmp_path / "none.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        KernelTable.load(broken)


def test_pick_takes_the_smallest_measured_size_at_or_above_else_the_largest(tmp_path):
    path = tmp_path / "kernel_table.json"
    path.write_text(json.dumps(TABLE))
    table = KernelTable.load(path)
    assert table.to_dict() == TABLE
    assert [table.pick("grouped_matmul", n, "x") for n in (1, 64, 65, 16384, 10**6)] == [
        "pallas", "pallas", "mosaic", "mosaic", "mosaic"]
    assert table.pick("ragged_paged_attention", 64, "x") == "mosaic"
    assert KernelTable.from_dict({"grouped_matmul": {"8": "xla"}}).pick(
        "ragged_paged_attention", 8, "pallas") == "pallas"
    hash(table)  # part of the model's static runtime


def test_the_probe_timings_make_a_table_of_the_fastest():
    rows = [{"op": "grouped_matmul", "size": 64, "impl": "pallas", "ms": 1.0},
            {"op": "grouped_matmul", "size": 64, "impl": "mosaic", "ms": 1.5},
            {"op": "grouped_matmul", "size": 64, "impl": "xla", "ms": 0.5, "error": "boom"},
            {"op": "grouped_matmul", "size": 16384, "impl": "mosaic", "ms": 2.0},
            {"op": "grouped_matmul", "size": 16384, "impl": "pallas", "ms": 3.0},
            {"op": "grouped_matmul", "size": 16384, "impl": "xla", "ms": 1.0, "format": "fp8"},
            {"op": "ragged_paged_attention", "size": 2048, "impl": "mosaic", "ms": 4.0},
            {"op": "stacked_matmul", "size": 8, "impl": "pallas", "ms": 0.1}]
    assert fastest(rows).to_dict() == {"grouped_matmul": {"64": "pallas", "16384": "mosaic"},
                                       "ragged_paged_attention": {"2048": "mosaic"}}


def test_the_chosen_ops_call_the_pick_at_each_size(monkeypatch):
    calls = []

    def fake(op, impl):
        if op == "grouped_matmul":
            return lambda *a, **k: calls.append(("gmm", impl))
        return (lambda *a, **k: calls.append(("plan", impl)),
                lambda *a, **k: calls.append(("attention", impl)))

    monkeypatch.setattr(choices, "_candidates", fake)
    kernels = choices.chosen(pallas_kernels.ops("pallas"), KernelTable.from_dict(TABLE))
    x = jax.ShapeDtypeStruct((8, 16), jnp.bfloat16)
    kernels.grouped_matmul(x, None, plan=pallas_kernels.plan_groups(
        jnp.array([4, 8], jnp.int32), num_rows=8, block_m=16))
    kernels.grouped_matmul(x, None, lhs_rows=jnp.zeros(20000, jnp.int32))
    xla = choices.chosen(pallas_kernels.ops("pallas"),
                         KernelTable.from_dict({"grouped_matmul": {"8": "xla"}}))
    xla.grouped_matmul(x, None)
    weight = quantize(jnp.ones((1, 2, 64, 64), jnp.bfloat16), "int8")
    xla.grouped_matmul(x, weight)  # quantised weights: the kernel, never ragged_dot
    kernels.plan_attention(None, None, None, num_tokens=2048)
    kernels.ragged_paged_attention(jax.ShapeDtypeStruct((8, 4, 16), jnp.bfloat16))
    assert calls == [("gmm", "pallas"), ("gmm", "mosaic"), ("gmm", "xla"), ("gmm", "pallas"),
                     ("plan", "mosaic"),
                     ("attention", "pallas")]
    assert kernels.stacked_matmul is pallas_kernels.stacked_matmul


def test_the_runtime_applies_a_table_to_kernels_only():
    table = KernelTable.from_dict(TABLE)
    assert Runtime("pallas", kernel_table=table).kernels.grouped_matmul \
        is not pallas_kernels.grouped_matmul
    assert Runtime("pallas").kernels.grouped_matmul is pallas_kernels.grouped_matmul
    reference = Runtime("reference", kernel_table=table).kernels
    assert reference.grouped_matmul is pallas_kernels.grouped_matmul_reference
