"""Pipeline stages: the bubble against the batches in flight, ticks against turns.

On 8 simulated CPU devices, a Qwen3-MoE of dummy weights (8 MoE layers, one segment, so
D = P batches fill the pipeline) decodes N concurrent greedy requests under
`pipeline_parallel_size` P, two ways in one run:

  ticks    the engine's loop (serving/engine/pipeline.py): each step is one tick, the
           batch at each of the P virtual stages runs on its stage, N requests split into
           min(N, P) batches in flight.
  in_turn  the one-batch staged step (qwen_jax/model.py `run_segment_staged`, what
           several processes run): the stages take turns within a step, so each stage
           works one turn in P (the bubble is (P - 1) / P at any load).

Reported per (P, N): the ticks loop's bubble fraction (virtual-stage slots that held no
batch, over all ticks), its idle stage-ticks, and output tokens/s of both ways with
their ratio. On this CPU all simulated devices share the cores, so tokens/s count the
work each way does (in turn, every stage computes in every turn and drops what is not
its turn's), not what P GPUs would overlap.

    PYTHONPATH=. python benchmarks/pipeline_bubble.py [--stages 2 4] [--requests 1 2 4 8 16]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from qwen_jax import LLM, SamplingParams  # noqa: E402
from serving.engine.pipeline import PipelineStats  # noqa: E402
from serving.executor.model_runner import ModelRunner  # noqa: E402

CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512,
              hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
              num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
              num_experts=16, num_experts_per_tok=4, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
              max_position_embeddings=1024, tie_word_embeddings=False, torch_dtype="float32",
              bos_token_id=1, eos_token_id=2)


def make_llm(model_dir: str, stages: int, num_requests: int) -> LLM:
    seqs = max(8, num_requests)
    return LLM(model_dir, load_format="dummy", pipeline_parallel_size=stages,
               max_num_seqs=seqs, seq_buckets=[seqs], token_buckets=[16, 64],
               max_num_batched_tokens=64, max_model_len=256, show_progress=False,
               compilation_cache_dir=None)


def in_turn(llm: LLM) -> LLM:
    """The same engine with the one-batch staged step instead of ticks."""
    engine = llm.llm_engine
    runner = engine.runner
    engine.runner = ModelRunner(engine.model, runner.kv_caches,
                                max_model_len=runner.max_model_len,
                                pages_per_seq=runner.pages_per_seq, mesh=engine.mesh,
                                max_num_seqs=runner.max_num_seqs)
    engine.runner.precompile(engine.bucket_pairs, progress=False)
    engine.pipeline, engine.scheduler.pipeline_depth = None, 1
    return llm


def decode(llm: LLM, num_requests: int, max_tokens: int) -> float:
    """Output tokens/s of `num_requests` greedy requests of 8-token prompts."""
    rng = np.random.default_rng(num_requests)
    prompts = [{"prompt_token_ids": rng.integers(3, 500, size=8).tolist()}
               for _ in range(num_requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm
    if llm.llm_engine.pipeline is not None:  # count the measured run's ticks alone
        llm.llm_engine.pipeline.stats = PipelineStats()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(CONFIG))
        for stages in args.stages:
            for num_requests in args.requests:
                llm = make_llm(model_dir, stages, num_requests)
                ticks = decode(llm, num_requests, args.max_tokens)
                stats = llm.stats()
                turns = decode(in_turn(llm), num_requests, args.max_tokens)
                print(json.dumps({
                    "pipeline_parallel_size": stages, "requests": num_requests,
                    "batches_in_flight": min(num_requests, stages),
                    "bubble_fraction": round(stats["pipeline_bubble_fraction"], 3),
                    "idle_stage_ticks": stats["pipeline_idle_stage_ticks"],
                    "ticks": stats["pipeline_ticks"],
                    "in_turn_bubble_fraction": round((stages - 1) / stages, 3),
                    "ticks_tok_s": round(ticks, 1), "in_turn_tok_s": round(turns, 1),
                    "ticks_over_in_turn": round(ticks / turns, 2)}), flush=True)


if __name__ == "__main__":
    main()
