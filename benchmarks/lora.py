"""Multi-LoRA throughput on the tiny model, side by side in one process: output tokens/s
of the same batch with no adapter (an engine without LoRA, and one with 8 slots whose
requests use none), one adapter for every request, and 4 and 8 distinct adapters mixed
in each step. Adapters: peft rank-16 all-linear (attention, experts, router) on the
tiny model, saved in a temporary directory (needs the test extras: torch, peft).
Prints one JSON object: the median of `--rounds` alternating rounds after a warm-up,
and each ratio to the engine without LoRA.

    PYTHONPATH=. python benchmarks/lora.py [--rounds 5] [--num-prompts 32] [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This folder's kernels.py would shadow the `kernels` package transformers imports.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from qwen_jax import LLM, LoRARequest, SamplingParams  # noqa: E402
from qwen_jax.weights import DEFAULT_MODEL_DIR  # noqa: E402

ENGINE = dict(show_progress=False, enable_prefix_caching=False, max_num_seqs=32,
              max_num_batched_tokens=512, token_buckets=[32, 128, 512], seq_buckets=[32])


def save_adapters(directory: Path, count: int, rank: int) -> list[LoRARequest]:
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3MoeForCausalLM
    base = Qwen3MoeForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, dtype=torch.float32)
    loras = []
    for i in range(count):
        torch.manual_seed(i)
        config = LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear",
                            init_lora_weights=False)
        get_peft_model(copy.deepcopy(base), config).save_pretrained(str(directory / f"a{i}"))
        loras.append(LoRARequest(f"a{i}", i + 1, str(directory / f"a{i}")))
    return loras


def run(llm: LLM, prompts, params, loras) -> float:
    """Output tokens/s of one generate call (request i runs loras[i % len], or none)."""
    per_request = [loras[i % len(loras)] for i in range(len(prompts))] if loras else None
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=per_request)
    elapsed = time.perf_counter() - started
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    prompts = [{"prompt_token_ids": list(range(3, 3 + 8 + (7 * i) % 40))}
               for i in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = save_adapters(Path(tmp), 8, args.rank)
        plain = LLM(**ENGINE)
        lora = LLM(**ENGINE, enable_lora=True, max_loras=8, max_lora_rank=args.rank)
        cases = {"no_lora_engine": (plain, []), "none": (lora, []),
                 "one": (lora, adapters[:1]), "mixed_4": (lora, adapters[:4]),
                 "mixed_8": (lora, adapters)}
        for llm, loras in cases.values():  # warm-up: adapters load, buckets compile
            run(llm, prompts, params, loras)
        rates: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (llm, loras) in cases.items():
                rates[name].append(run(llm, prompts, params, loras))
    median = {name: statistics.median(r) for name, r in rates.items()}
    print(json.dumps({
        "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "rank": args.rank,
        "rounds": args.rounds, "output_tokens_per_s": median,
        "ratio_to_no_lora_engine": {name: rate / median["no_lora_engine"]
                                    for name, rate in median.items()},
        "all_rounds": rates}, indent=2))


if __name__ == "__main__":
    main()
