"""LoRA options (vLLM's names): the engine's (`--enable-lora`, `--max-loras`, ...), shared by
`serve`, `generate` and `bench throughput`, and `--lora-modules`, the adapters registered at
start, each `NAME=PATH` or vLLM's JSON form `{"name": ..., "path": ..., "base_model_name":
...}`, numbered 1, 2, ... in the order given. No jax."""

from __future__ import annotations

import argparse
import json

from serving.core.lora_request import LoRARequest

LORA_ENGINE_ARG_NAMES = ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")
MODULE_FIELDS = ("name", "path", "base_model_name")


def parse_lora_module(text: str, lora_int_id: int) -> LoRARequest:
    """One `--lora-modules` item; ValueError naming what is wrong with it."""
    if text.lstrip().startswith("{"):
        try:
            item = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"{text!r} is not valid JSON: {exc}") from None
        if not isinstance(item, dict):
            raise ValueError(f"{text!r} must be a JSON object")
        unknown = sorted(set(item) - set(MODULE_FIELDS))
        if unknown:
            raise ValueError(f"{text!r} has unknown field(s) {unknown}; allowed: "
                             f"{', '.join(MODULE_FIELDS)}")
        name, path, base = item.get("name"), item.get("path"), item.get("base_model_name")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise ValueError(f"{text!r} is neither NAME=PATH nor a JSON object")
        base = None
    for field, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{text!r}: {field} must be a non-empty string, got {value!r}")
    if base is not None and not isinstance(base, str):
        raise ValueError(f"{text!r}: base_model_name must be a string, got {base!r}")
    return LoRARequest(str(name), lora_int_id, str(path), base)


class LoRAModulesAction(argparse.Action):
    """Collects `--lora-modules` items (the flag may repeat) as LoRARequests with ids in
    order; a bad item or a repeated name is an error naming the flag."""

    def __call__(self, parser, namespace, values, option_string=None):
        modules = list(getattr(namespace, self.dest, None) or [])
        for text in values:
            try:
                module = parse_lora_module(text, len(modules) + 1)
            except ValueError as exc:
                raise argparse.ArgumentError(self, str(exc)) from None
            if any(m.lora_name == module.lora_name for m in modules):
                raise argparse.ArgumentError(
                    self, f"adapter name {module.lora_name!r} is given twice")
            modules.append(module)
        setattr(namespace, self.dest, modules)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters", "multi-LoRA serving (vLLM's options)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT directories) beside the base model")
    g.add_argument("--lora-modules", nargs="+", action=LoRAModulesAction, default=[],
                   metavar="NAME=PATH",
                   help="adapters registered at start: NAME=PATH or '{\"name\": ..., "
                        "\"path\": ..., \"base_model_name\": ...}'; a request names one as "
                        "its model (needs --enable-lora)")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters in device slots at once; more wait for a free slot (1)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest adapter rank the slots hold (16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept packed in host memory (default: --max-loras)")


def check_lora_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exits with a usage error when `--lora-modules` comes without `--enable-lora`."""
    if getattr(args, "lora_modules", None) and not args.enable_lora:
        parser.error("--lora-modules needs --enable-lora (LoRA is off without it)")
