"""Engine options shared by `qwen-jax serve`, `generate` and `bench throughput` (vLLM names)."""

from __future__ import annotations

import argparse

from qwen_jax.options import KV_CACHE_DTYPES, LOAD_FORMATS, PARAM_DTYPES, QUANTIZATION_METHODS


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
    g.add_argument("--impl", default="auto", choices=("auto", "pallas", "reference"),
                   help="kernels: pallas on GPU, jnp reference elsewhere (auto)")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
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
    g.add_argument("--gpu-memory-utilization", "--kv-cache-fraction", type=float, default=0.9,
                   dest="gpu_memory_utilization")
    g.add_argument("--kv-cache-dtype", default="auto", choices=tuple(KV_CACHE_DTYPES))
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                   dest="policy")
    g.add_argument("--max-waiting", type=int, default=None,
                   help="bound on queued requests; beyond it the server answers 503")
    g.add_argument("--watermark", type=float, default=0.01)
    g.add_argument("--token-buckets", type=_int_list, default=None)
    g.add_argument("--seq-buckets", type=_int_list, default=None)
    g.add_argument("--compilation-cache-dir", default="default",
                   help="persistent XLA cache ('' disables)")
    g.add_argument("--no-precompile", action="store_false", dest="precompile")
    add_parallel_args(parser)


def add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    g.add_argument("--coordinator-address", default=None,
                   help="multi-host: host:port of process 0 (jax.distributed)")
    g.add_argument("--num-processes", type=int, default=None)
    g.add_argument("--process-id", type=int, default=None)


ENGINE_ARG_NAMES = (
    "tokenizer", "dtype", "impl", "load_format", "quantization", "seed", "max_num_seqs",
    "max_num_batched_tokens", "max_model_len", "block_size", "num_gpu_blocks_override",
    "gpu_memory_utilization", "kv_cache_dtype", "enable_prefix_caching", "policy",
    "max_waiting", "watermark", "token_buckets", "seq_buckets", "compilation_cache_dir",
    "precompile", "tensor_parallel_size", "expert_parallel_size", "data_parallel_size")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Namespace -> keyword arguments of `LLM(model, **kwargs)` / `AsyncLLM`."""
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES if hasattr(args, name)}
