"""How close each weight format keeps the embedded tiny model to its float weights, one JSON
line per format: bytes of the params as stored, and over the tiny model's chat prompts
(`--per-task` per task) the mean KL divergence of the next-token distributions from the
float model's, how often the most likely token is the same, and the largest logit error.

    python benchmarks/quantized_tiny.py [--per-task 8] [--out FILE]

Formats: fp8 (scripts/quantize_checkpoint.py, Qwen's 128 x 128 blocks), awq (the script,
AutoAWQ GEMM with group_size 32: the tiny model's expert FFN is 32 wide), int8 and fp8
quantised at load from the float checkpoint (`--quantization`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # runs from a checkout without an install
    sys.path.insert(0, str(REPO))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from qwen_jax import Qwen3ForCausalLM  # noqa: E402
from scripts.quantize_checkpoint import quantise  # noqa: E402
from serving.bench.eval_tasks import TINY_MODEL, prompt_batch  # noqa: E402


def closeness(model, batch, mask, reference) -> dict:
    logits = np.asarray(model(jnp.asarray(batch)))[mask]
    ours, theirs = jax.nn.log_softmax(logits), jax.nn.log_softmax(reference)
    return {"kl": float(np.mean(np.sum(np.exp(theirs) * (theirs - ours), axis=-1))),
            "top1_agreement": float(np.mean(ours.argmax(-1) == theirs.argmax(-1))),
            "max_abs_logit_error": float(np.abs(logits - reference).max()),
            "positions": int(mask.sum())}


def stored_bytes(model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-task", type=int, default=8)
    parser.add_argument("--out", help="also append the JSON lines here")
    args = parser.parse_args(argv)
    batch, mask = prompt_batch(args.per_task)
    float_model = Qwen3ForCausalLM.from_pretrained(TINY_MODEL)
    reference = np.asarray(float_model(jnp.asarray(batch)))[mask]
    with tempfile.TemporaryDirectory() as tmp:
        models = {"float32": lambda: float_model}
        for fmt, group in (("fp8", 128), ("awq", 32)):
            quantise(TINY_MODEL, Path(tmp) / fmt, fmt, block=(128, 128), group=group)
            models[fmt] = lambda fmt=fmt: Qwen3ForCausalLM.from_pretrained(Path(tmp) / fmt)
        for fmt in ("int8", "fp8"):
            models[f"{fmt} (at load)"] = lambda fmt=fmt: Qwen3ForCausalLM.from_pretrained(
                TINY_MODEL, quantization=fmt)
        for name, make in models.items():
            model = make()
            row = {"format": name, "param_bytes": stored_bytes(model),
                   **closeness(model, batch, mask, reference)}
            line = json.dumps(row)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
