"""The three MoE dispatch/combine strategies of benchmarks/moe_comm.py (replicated tokens +
psum, all-gather + reduce-scatter, all-to-all) equal the single-device MoE on 8 simulated
devices at EP=4 x TP=2 (both mesh axes: expert all-to-all / gather and the F psum)."""

import importlib.util
import pathlib

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import grouped_matmul_reference
from qwen_jax.sharding import make_mesh

_PATH = pathlib.Path(__file__).parents[2] / "benchmarks" / "moe_comm.py"
_spec = importlib.util.spec_from_file_location("moe_comm", _PATH)
moe_comm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(moe_comm)


def test_strategies_match_single_device(ep=4, tp=2):
    top_k, gmm = 4, grouped_matmul_reference
    x, gate, gate_up, down = moe_comm.make_inputs(0, tokens=16, dim=32, experts=16, ffn=16)
    want = np.asarray(moe_comm.reference(x, gate, gate_up, down, top_k, gmm))
    mesh = make_mesh(tp, ep)
    weights = (jax.device_put(gate, NamedSharding(mesh, P())),
               jax.device_put(gate_up, NamedSharding(mesh, moe_comm.GATE_UP_SPEC)),
               jax.device_put(down, NamedSharding(mesh, moe_comm.DOWN_SPEC)))
    fns = moe_comm.strategy_fns(mesh, top_k, gmm)
    assert set(fns) == set(moe_comm.STRATEGIES)
    for name, (fn, tok) in fns.items():
        got = fn(jax.device_put(x, NamedSharding(mesh, tok)), *weights)
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, err_msg=name)
