"""One process of the two-process test: `python multihost_worker.py CKPT PORT ID OUT
[LAYOUT]`. Process 0 serves a few requests over a mesh spanning both processes (LAYOUT: a
JSON object of parallel sizes; default TP=8) and writes the tokens to OUT; process 1
follows its steps."""

import json
import sys

import jax

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 4)

from serving.executor import distributed  # noqa: E402

ckpt, port, process_id, out_path = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
distributed.initialize(f"127.0.0.1:{port}", 2, process_id)
assert len(jax.devices()) == 8 and len(jax.local_devices()) == 4

from qwen_jax import LLM, SamplingParams  # noqa: E402
from tests.sharding.multihost_prompts import ARGS, PROMPTS  # noqa: E402

layout = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {"tensor_parallel_size": 8}
llm = LLM(ckpt, **layout, **ARGS)
if distributed.is_leader():
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    distributed.publish_stop()
    if layout.get("pipeline_parallel_size", 1) > 1:  # the stages ran as pipeline ticks
        assert llm.llm_engine.pipeline.stats.num_ticks > 0
    with open(out_path, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
else:
    distributed.follower_loop(llm.llm_engine)
jax.distributed.shutdown()
