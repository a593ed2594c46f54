"""`qwen-jax serve | generate | bench | convert`.

Each subcommand is a pair: `_add_<name>(subparsers)` declares its arguments and sets
`func` to `_run_<name>(args) -> int`. To add one, write the pair and append the adder to
`SUBCOMMANDS`. Heavy imports (jax, the model) happen inside `_run_*` so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time

DTYPES = ("float32", "bfloat16", "float16")


# ---- convert ---------------------------------------------------------------------------
def _add_convert(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert an HF safetensors checkpoint to an orbax checkpoint",
        description="Load an HF checkpoint directory (or a preset name, for dummy weights) "
                    "and save its params with orbax, plus config.json and tokenizer files.")
    p.add_argument("--model", required=True, help="HF checkpoint directory or preset name")
    p.add_argument("--output", required=True, help="directory to write the orbax checkpoint to")
    p.add_argument("--dtype", default="float32", choices=DTYPES,
                   help="parameter dtype of the saved checkpoint (default: float32)")
    p.set_defaults(func=_run_convert)


def _run_convert(args) -> int:
    from pathlib import Path

    from qwen_jax import checkpoint
    from qwen_jax.weights import load_model, param_count

    start = time.perf_counter()
    model = load_model(args.model, dtype=args.dtype, load_format="auto")
    source_dir = args.model if Path(args.model).is_dir() else None
    out = checkpoint.save(model, args.output, source_dir=source_dir)
    seconds = time.perf_counter() - start
    num_params = param_count(model.config)
    print(f"converted {args.model} -> {out}: {num_params:,} params ({num_params / 1e9:.2f} B), "
          f"{args.dtype}, {seconds:.1f} s")
    return 0


# ---- dispatch --------------------------------------------------------------------------
# serve / generate / bench: add `_add_serve` etc. here (same shape as `_add_convert`).
SUBCOMMANDS = (_add_convert,)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qwen-jax", description="Serve Qwen3 / Qwen3-MoE with JAX on NVIDIA GPUs.")
    subparsers = parser.add_subparsers(dest="command")
    subparsers.required = True
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point: parse `argv` (default sys.argv[1:]) and run the subcommand."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
