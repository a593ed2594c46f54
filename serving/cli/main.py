"""`qwen-jax serve | generate | bench | eval | convert | plan`.

Each subcommand is a pair: `_add_<name>(subparsers)` declares its arguments and sets
`func` to `_run_<name>(args) -> int`. To add one, write the pair and append the adder to
`SUBCOMMANDS`. Heavy imports (jax, the model) happen inside `_run_*` so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time

from qwen_jax.options import PARAM_DTYPES, QUANTIZATION_METHODS


# ---- convert ---------------------------------------------------------------------------
def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert an HF safetensors checkpoint to an orbax checkpoint",
        description="Load an HF checkpoint directory (or a preset name, for dummy weights) "
                    "and save its params with orbax, plus config.json and tokenizer files.")
    p.add_argument("--model", required=True, help="HF checkpoint directory or preset name")
    p.add_argument("--output", required=True, help="directory to write the orbax checkpoint to")
    p.add_argument("--dtype", default="float32", choices=PARAM_DTYPES,
                   help="parameter dtype of the saved checkpoint (default: float32)")
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="save quantised weights: fp8 | int8 quantise a float checkpoint "
                        "(fp8 / AWQ checkpoints stay quantised without it)")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> int:
    from pathlib import Path

    from qwen_jax import checkpoint
    from qwen_jax.model import Qwen3ForCausalLM
    from qwen_jax.planner import param_count

    start = time.perf_counter()
    model = Qwen3ForCausalLM.from_pretrained(args.model, args.dtype,
                                             quantization=args.quantization)
    source_dir = args.model if Path(args.model).is_dir() else None
    out = checkpoint.save(model, args.output, source_dir=source_dir)
    seconds = time.perf_counter() - start
    num_params = param_count(model.config)
    quantization = model.config.quantization
    weights = args.dtype if quantization is None else f"{quantization.method}, rest {args.dtype}"
    print(f"converted {args.model} -> {out}: {num_params:,} params ({num_params / 1e9:.2f} B), "
          f"{weights}, {seconds:.1f} s")
    return 0


# ---- generate --------------------------------------------------------------------------
_SAMPLING_OPTIONS = (  # (flag, type, SamplingParams field)
    ("--temperature", float, "temperature"), ("--top-p", float, "top_p"),
    ("--top-k", int, "top_k"), ("--min-p", float, "min_p"),
    ("--max-tokens", int, "max_tokens"), ("--min-tokens", int, "min_tokens"),
    ("--repetition-penalty", float, "repetition_penalty"),
    ("--presence-penalty", float, "presence_penalty"),
    ("--frequency-penalty", float, "frequency_penalty"),
    ("--sampling-seed", int, "seed"))


def _add_generate(subparsers) -> None:
    from serving.cli.args import add_engine_args
    p = subparsers.add_parser(
        "generate", help="offline generation over a JSONL file (resumable)",
        description="Each input line: {\"id\", \"prompt\" (text or token ids) | \"messages\", "
                    "optional SamplingParams fields, e.g. \"structured_outputs\": {\"json\": "
                    "SCHEMA}}. One result line per id is appended to --output as it "
                    "finishes; rerunning skips the ids already there.")
    p.add_argument("--input", required=True, help="prompts JSONL")
    p.add_argument("--output", required=True, help="results JSONL (appended to; resumable)")
    p.add_argument("--errors", default=None,
                   help="bad-line report JSONL (default: OUTPUT.errors.jsonl, if any)")
    p.add_argument("--no-progress", action="store_false", dest="progress")
    add_engine_args(p)
    g = p.add_argument_group("sampling defaults (a line's own fields override them; without "
                             "a seed, a line samples with one derived from --seed and its id)")
    for flag, kind, field in _SAMPLING_OPTIONS:
        g.add_argument(flag, type=kind, default=None, dest=f"sp_{field}",
                       metavar=field.upper())
    g.add_argument("--stop", action="append", default=None, dest="sp_stop", metavar="TEXT")
    g.add_argument("--ignore-eos", action="store_true", default=None, dest="sp_ignore_eos")
    p.set_defaults(func=_run_generate)


def _run_generate(args) -> int:
    import json

    from serving.cli.args import engine_kwargs
    from serving.entrypoints.generate_file import generate_file

    sampling = {k[3:]: v for k, v in vars(args).items() if k.startswith("sp_") and v is not None}
    summary = generate_file(args.input, args.output, model=args.model,
                            engine_kwargs={**engine_kwargs(args), "show_progress": args.progress},
                            default_sampling=sampling,
                            errors_path=args.errors, progress=args.progress,
                            base_seed=args.seed, lora_modules=args.lora_modules)
    print(json.dumps(summary))
    return 0


# ---- bench -----------------------------------------------------------------------------
def _add_bench(subparsers) -> None:
    from serving.bench.args import add_serve_args, add_throughput_args
    from serving.cli.args import add_engine_args
    p = subparsers.add_parser("bench", help="serving and offline throughput benchmarks")
    kinds = p.add_subparsers(dest="bench_command")
    kinds.required = True
    serve = kinds.add_parser(
        "serve", help="load-test an OpenAI-compatible server (vLLM's bench serve metrics)")
    add_serve_args(serve)
    serve.set_defaults(func=_run_bench_serve)
    throughput = kinds.add_parser(
        "throughput", help="offline throughput: every request submitted at once via LLM")
    add_engine_args(throughput)
    add_throughput_args(throughput)
    throughput.set_defaults(func=_run_bench_throughput)


def _run_bench_serve(args) -> int:
    from serving.bench.load_generator import bench_serve, plot_files
    try:
        if args.plot_results:
            print(f"plot: {plot_files(args)}")
            return 0
        report = bench_serve(args)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    return 0 if report["completed"] else 1


def _run_bench_throughput(args) -> int:
    from serving.bench.throughput import bench_throughput
    from serving.cli.args import engine_kwargs
    bench_throughput(args, {**engine_kwargs(args), "show_progress": args.progress},
                     lora_requests=args.lora_modules)
    return 0


# ---- serve -----------------------------------------------------------------------------
def _add_serve(subparsers) -> None:
    from serving.cli.args import add_engine_args
    from serving.parsers.reasoning import REASONING_PARSERS
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
        description="Serve the model over an OpenAI-compatible REST API (see docs/api.md). "
                    "Binds loopback unless --host says otherwise.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 routes "
                        "(default: $QWEN_JAX_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients send and /v1/models lists (default: --model)")
    p.add_argument("--max-request-body-mb", type=float, default=8.0)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM before abort")
    p.add_argument("--log-interval", type=float, default=10.0,
                   help="seconds between throughput / KV-usage log lines (0: off)")
    p.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split a thinking model's chat replies: <think>...</think> goes to "
                        "message.reasoning_content (delta.reasoning_content when streamed), "
                        "the rest to content (default: none, all in content)")
    _add_chat_args(p)
    p.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="CORS: origins browsers may call the API from (e.g. "
                        "https://app.example.com; '*' for any; a JSON list as vLLM takes "
                        "works too); default none, no CORS headers")
    p.add_argument("--metrics-prefix", default="qwen_jax", choices=("qwen_jax", "vllm"),
                   help="name /metrics with vLLM's names (vllm:...) so vLLM dashboards and "
                        "autoscalers work unchanged (default: qwen_jax:...)")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="step the engine in a process of its own, as vLLM's engine core, so "
                        "the HTTP handlers and the engine loop do not share one GIL "
                        "(multi-host leaders step in their own process)")
    p.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
                        "on with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, as vLLM's)")
    _add_data_parallel_args(p)
    add_engine_args(p)
    p.set_defaults(func=_run_serve)


def _add_data_parallel_args(p) -> None:
    from serving.engine.data_parallel import ROUTING_POLICIES
    g = p.add_argument_group("data parallel serving (--data-parallel-size > 1)")
    g.add_argument("--data-parallel-routing", default="prefix", choices=ROUTING_POLICIES,
                   help="which replica takes a request: prefix (the one holding its leading "
                        "KV pages, unless it is busier than the least loaded by more than "
                        "max(4, half its load)), least_loaded, round_robin (default prefix)")
    g.add_argument("--max-replica-restarts", type=int, default=3,
                   help="times in a row a dead replica is started again before it stays "
                        "down (3); the server exits once every replica is down")
    g.add_argument("--replica-restart-backoff", type=float, default=2.0,
                   help="seconds before a dead replica's first restart, doubled per try (2)")


def _json_object(text: str) -> dict:
    import json
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _add_chat_args(p) -> None:
    from serving.parsers.tool_parsers import TOOL_PARSERS
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="parse tool calls out of chat replies into message.tool_calls "
                        "(delta.tool_calls when streamed); hermes is Qwen3's format")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (the tokenizer's config and chat template; "
                        "vLLM's option)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice \"auto\" (the default when a request has tools): "
                        "the model decides whether to call; needs --tool-call-parser")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) used instead of "
                        "the checkpoint's")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   metavar="JSON", help="chat template variables for every request, e.g. "
                                        "'{\"enable_thinking\": false}'; a request's own "
                                        "chat_template_kwargs override them")


def _run_serve(args) -> int:
    from serving.cli.args import engine_kwargs
    from serving.entrypoints.openai.serve_process import run
    return run(args, engine_kwargs(args))


# ---- plan ------------------------------------------------------------------------------
def _add_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", help="memory plan: per-device weights, KV pages and tokens for a layout")
    p.add_argument("--model", required=True, help="checkpoint directory or preset name")
    p.add_argument("--dtype", default="bfloat16", choices=PARAM_DTYPES)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="pipeline stages of TP x EP devices, each holding 1 / PP of the "
                        "layers and their KV")
    p.add_argument("--device-memory-gb", type=float, default=141.0,
                   help="memory of one device in GB (default: an H200's 141)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                   help="weights in fp8 | int8 | awq (int4) (default: the checkpoint's)")
    p.add_argument("--max-loras", type=int, default=0,
                   help="LoRA adapter slots counted beside the weights (serve's --max-loras "
                        "with --enable-lora; default 0: none)")
    p.add_argument("--max-lora-rank", type=int, default=16,
                   help="the rank each LoRA slot holds (16)")
    p.set_defaults(func=_run_plan)


def _run_plan(args) -> int:
    from qwen_jax.config import ModelConfig
    from qwen_jax.planner import plan_memory
    try:
        plan = plan_memory(ModelConfig.from_hf(args.model), dtype=args.dtype,
                           tensor_parallel_size=args.tensor_parallel_size,
                           expert_parallel_size=args.expert_parallel_size,
                           device_memory_bytes=int(args.device_memory_gb * 1e9),
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           block_size=args.block_size, quantization=args.quantization,
                           max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                           pipeline_parallel_size=args.pipeline_parallel_size)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"{args.model} {plan.summary()}")
    return 0


# ---- dispatch --------------------------------------------------------------------------
# ---- eval ------------------------------------------------------------------------------
def _add_eval(subparsers) -> None:
    from serving.bench.args import EVAL_DESCRIPTION, add_eval_args
    p = subparsers.add_parser("eval", help="accuracy of a model on the tiny model's tasks",
                              description=EVAL_DESCRIPTION)
    add_eval_args(p)
    p.set_defaults(func=_run_eval)


def _run_eval(args) -> int:
    from serving.bench.eval_tasks import run_eval
    return run_eval(args)


SUBCOMMANDS = (_add_convert, _add_generate, _add_bench, _add_eval, _add_serve, _add_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen-jax", description="Serve Qwen3 / Qwen3-MoE with JAX on NVIDIA GPUs.")
    subparsers = parser.add_subparsers(dest="command")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse `argv` (default sys.argv[1:]) and run the subcommand.

    Multi-host (`--coordinator-address`): every process joins `jax.distributed`; process 0
    runs the command (and its scheduler), the others follow its steps until it stops."""
    from serving.cli.lora_args import check_lora_args
    parser = build_parser()
    args = parser.parse_args(argv)
    check_lora_args(parser, args)
    if getattr(args, "coordinator_address", None) is None:
        return args.func(args)
    from serving.engine.multihost import run_multihost
    return run_multihost(lambda: args.func(args), lambda: _engine(args),
                         coordinator_address=args.coordinator_address,
                         num_processes=args.num_processes, process_id=args.process_id)


def _engine(args):
    from serving.cli.args import engine_kwargs
    from serving.engine.config import engine_config_from_kwargs
    from serving.engine.llm_engine import LLMEngine
    return LLMEngine(engine_config_from_kwargs(args.model, **engine_kwargs(args)))


if __name__ == "__main__":
    sys.exit(main())
