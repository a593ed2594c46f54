"""Two processes on localhost (CPU, jax.distributed with gloo, 4 devices each) serve a few
requests over one mesh spanning both (TP=8; PP=2 x TP=4: a pipeline stage per process)
with the same tokens as one process on one device."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from qwen_jax import LLM, SamplingParams
from tests.helpers.hf import save_hf_model
from tests.sharding.multihost_prompts import ARGS, PROMPTS

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 8},
                                    {"pipeline_parallel_size": 2, "tensor_parallel_size": 4}],
                         ids=["tp8", "pp2_tp4"])
def test_two_processes_match_one(tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    save_hf_model(ckpt, moe=True, num_attention_heads=8, num_key_value_heads=2, num_experts=8,
                  moe_intermediate_size=16, intermediate_size=32, vocab_size=96, seed=9)
    expected = [o.outputs[0].token_ids for o in LLM(str(ckpt), **ARGS).generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    port, out = _free_port(), tmp_path / "tokens.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests/sharding/multihost_worker.py"),
                               str(ckpt), str(port), str(i), str(out),
                               json.dumps(layout)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(l[-3000:] for l in logs)
    assert json.loads(out.read_text()) == expected
