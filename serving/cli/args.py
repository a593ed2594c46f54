"""Engine options shared by `qwen-jax serve`, `generate` and `bench throughput` (vLLM names)."""

from __future__ import annotations

import argparse

from qwen_jax.options import KV_CACHE_DTYPES, LOAD_FORMATS, PARAM_DTYPES, QUANTIZATION_METHODS
from serving.cli.lora_args import LORA_ENGINE_ARG_NAMES, add_lora_args
from serving.core.config import POLICIES


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (default: the embedded tiny model)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto", choices=("auto", *PARAM_DTYPES))
    g.add_argument("--impl", default="auto", choices=("auto", "pallas", "mosaic", "reference"),
                   help="kernels: pallas (Triton) on GPU, jnp reference elsewhere (auto); "
                        "mosaic: Mosaic GPU kernels where they apply")
    g.add_argument("--kernel-table", default=None, metavar="FILE",
                   help="the device probe's kernel_table.json: each op's fastest kernel per "
                        "shape (default: --impl everywhere)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding config, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
                        '\'{"method": "draft_model" | "eagle3", "model": DIR, '
                        '"num_speculative_tokens": 3}\' (no model: the embedded model\'s '
                        'draft or EAGLE-3 head; default: off)')
    g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weights: fp8 / awq checkpoints load quantised without it; fp8 | int8 "
                        "quantise a float checkpoint at load (presets: any)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=512)
    g.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings, at most 4096")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--max-waiting", type=int, default=None,
                   help="bound on queued requests; beyond it the server answers 503")
    g.add_argument("--token-buckets", type=_int_list, default=None)
    g.add_argument("--seq-buckets", type=_int_list, default=None)
    g.add_argument("--compilation-cache-dir", default="default",
                   help="persistent XLA cache ('' disables)")
    g.add_argument("--no-precompile", action="store_false", dest="precompile")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="overlap scheduling, input building and output processing with the "
                        "device step (steps with grammar masks run serially)")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="a streamed request gets an output every this many tokens (its "
                        "first token and its finish at once); larger values cost the host "
                        "less per token at many streams (vLLM's option; 1)")
    g.add_argument("--generation-config", default="auto",
                   help="sampling defaults for requests that omit them: 'auto' reads the "
                        "model's generation_config.json (Qwen3: temperature 0.6, top_p 0.95, "
                        "top_k 20), 'vllm' uses neutral ones (temperature 1), or a directory "
                        "holding a generation_config.json")
    add_scheduling_args(parser)
    add_parallel_args(parser)
    add_lora_args(parser)


def add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "scheduling", "order, self-protection under pressure and KV swap (docs/api.md); "
        "a duration of inf turns its rule off")
    g.add_argument("--scheduling-policy", default="fcfs", choices=POLICIES, dest="policy",
                   help="length-aware: short prompts first, every request aging (default fcfs)")
    g.add_argument("--length-buckets", type=_int_list, default=(128, 512),
                   help="prompt lengths splitting short < A <= medium < B <= long (128,512)")
    g.add_argument("--aging-interval", type=float, default=1.0,
                   help="seconds of waiting worth one length bucket: no request waits behind "
                   "one that arrived more than 2x this later (1.0)")
    g.add_argument("--short-preempt-wait", type=float, default=0.5,
                   help="seconds a short request waits before a running long request that "
                   "ranks below it is preempted for it (length-aware; 0.5)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prefill tokens one request gets in a step, so a long prompt's "
                   "chunks keep steps short for requests arriving meanwhile (vLLM's option); "
                   "0: no cap (default: the short bound under length-aware, 0 otherwise)")
    g.add_argument("--max-long-partial-prefills", type=int, default=None,
                   help="most requests with more prefill left than that cap computing a chunk "
                   "in one step (vLLM's option; default: 1 under length-aware, any otherwise)")
    g.add_argument("--boost-wait", type=float, default=0.2,
                   help="queue wait in seconds after which a request is boosted one level "
                   "(priority, length-aware; 0.2)")
    g.add_argument("--watermark", type=float, default=0.05,
                   help="fraction of KV pages admission keeps free, doubled while degraded")
    g.add_argument("--kv-plan-limit", type=float, default=0.92,
                   help="admission keeps held pages plus running requests' next-token pages "
                   "under this fraction of the cache; 1 turns it off (0.92)")
    g.add_argument("--degrade-kv-usage", type=float, default=0.9,
                   help="KV usage above which, held --degrade-after seconds, the token "
                   "budget drops to --degraded-token-fraction (0.9)")
    g.add_argument("--degrade-after", type=float, default=30.0)
    g.add_argument("--restore-kv-usage", type=float, default=0.8,
                   help="KV usage below which, held --restore-after seconds, the budget is "
                   "restored (0.8)")
    g.add_argument("--restore-after", type=float, default=30.0)
    g.add_argument("--degraded-token-fraction", type=float, default=0.5)
    g.add_argument("--swap-space", type=float, default=0,
                   help="GiB of host memory per device for preempted requests' KV pages; "
                   "0 recomputes them (vLLM's option)")
    g.add_argument("--swap-min-tokens", type=int, default=256,
                   help="preempted requests with fewer computed tokens are recomputed (256)")


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages, each of TP x EP devices holding 1 / PP of the "
                        "layers and their KV cache (the stages run in turn within a step)")
    g.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


SCHEDULING_ARG_NAMES = (
    "policy", "length_buckets", "aging_interval", "short_preempt_wait",
    "long_prefill_token_threshold", "max_long_partial_prefills", "boost_wait", "watermark",
    "kv_plan_limit", "degrade_kv_usage", "degrade_after", "restore_kv_usage", "restore_after",
    "degraded_token_fraction", "swap_space", "swap_min_tokens")
ENGINE_ARG_NAMES = (
    "tokenizer", "dtype", "impl", "kernel_table", "load_format", "quantization", "seed",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
    "num_gpu_blocks_override", "gpu_memory_utilization", "kv_cache_dtype",
    "enable_prefix_caching", "max_waiting", "token_buckets", "seq_buckets",
    "async_scheduling", "stream_interval", "compilation_cache_dir", "precompile",
    "tensor_parallel_size", "expert_parallel_size", "data_parallel_size",
    "pipeline_parallel_size",
    "generation_config", "speculative_config", *SCHEDULING_ARG_NAMES, *LORA_ENGINE_ARG_NAMES)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Namespace -> keyword arguments of `LLM(model, **kwargs)` / `AsyncLLM`."""
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}
