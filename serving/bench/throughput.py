"""`qwen-jax bench throughput`: offline, every request submitted at once through `LLM`."""

from __future__ import annotations

import json
import time

import numpy as np


def random_token_prompts(vocab_size: int, num_prompts: int, input_len: int, seed: int
                         ) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(0, vocab_size, size=input_len).tolist()}
            for _ in range(num_prompts)]


def bench_throughput(args, engine_kwargs: dict, lora_requests=()) -> dict:
    """`lora_requests` (`--lora-modules`): the requests take them in turn (none: the base)."""
    from serving.core.request import SamplingParams
    from serving.entrypoints.llm import LLM

    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    max_len = engine_kwargs.get("max_model_len") or 2048
    if args.input_len + args.output_len > max_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} "
                         f"exceeds --max-model-len {max_len}")
    started = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)
    engine = llm.llm_engine
    setup_s = time.perf_counter() - started
    # Ids below the tokenizer's vocabulary avoid special tokens; the model's vocab is padded.
    vocab = min(engine.model_config.vocab_size,
                engine.tokenizer.backend.get_vocab_size(with_added_tokens=False)
                if engine.tokenizer else engine.model_config.vocab_size)
    prompts = random_token_prompts(vocab, args.num_prompts, args.input_len, args.seed)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.output_len,
                            ignore_eos=True)
    started = time.perf_counter()
    loras = list(lora_requests or ())
    outputs = llm.generate(prompts, params, use_tqdm=args.progress, lora_request=[
        loras[i % len(loras)] for i in range(len(prompts))] if loras else None)
    elapsed = time.perf_counter() - started
    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    stats = engine.stats()
    report = {"num_requests": len(outputs), "input_len": args.input_len,
              "output_len": args.output_len, "num_loras": len(loras), "elapsed_time": elapsed,
              "requests_per_second": len(outputs) / elapsed,
              "tokens_per_second": (num_prompt + num_output) / elapsed,
              "output_tokens_per_second": num_output / elapsed,
              "total_prompt_tokens": num_prompt, "total_output_tokens": num_output,
              "load_seconds": engine.load_seconds, "compile_seconds": engine.compile_seconds,
              "setup_seconds": setup_s, "num_preemptions": stats["num_preemptions"],
              "spec_decode_mean_acceptance_length": stats["spec_decode_mean_acceptance_length"]}
    print(json.dumps(report, indent=2))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(report, f, indent=2)
    return report
