"""`qwen-jax generate --enable-lora --lora-modules ...`: a line's `lora` names a module or
gives its own adapter, and gets what `LLM.generate(..., lora_request=...)` gives; a bad
`lora` is reported with its line and field while the other lines complete."""

import json

import pytest

from qwen_jax.config import ModelConfig
from serving.cli.args import engine_kwargs
from serving.cli.main import build_parser, main
from serving.core.lora_request import LoRARequest
from serving.core.request import SamplingParams
from tests.helpers.lora import save_per_expert_adapter

ENGINE = ["--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-model-len", "64",
          "--token-buckets", "32", "--seq-buckets", "4", "--no-precompile",
          "--enable-lora", "--max-loras", "2", "--max-lora-rank", "4"]
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tokenizer_ckpt, compile_cache):
    """The command over a file naming both adapters, and the lines' results and errors."""
    ckpt, _ = tokenizer_ckpt
    root = tmp_path_factory.mktemp("generate_lora")
    cfg = ModelConfig.from_hf(ckpt)
    for i, name in enumerate(("a0", "a1")):
        save_per_expert_adapter(root / name, cfg, attention=("q_proj", "v_proj"), seed=i,
                                alpha=64)
    rows = [{"id": "base"}, {"id": "a0", "lora": "a0"},
            {"id": "a1", "lora": {"name": "a1", "path": str(root / "a1")}},
            {"id": "a1-again", "lora": "a1"},
            {"id": "unknown", "lora": "nope"},
            {"id": "other-path", "lora": {"name": "a0", "path": str(root / "a1")}}]
    inp, out = root / "in.jsonl", root / "out.jsonl"
    inp.write_text("".join(json.dumps({"prompt": PROMPT, "max_tokens": 6, "ignore_eos": True,
                                       **row}) + "\n" for row in rows))
    argv = ["generate", "--model", str(ckpt), "--input", str(inp), "--output", str(out),
            "--compilation-cache-dir", compile_cache, "--no-progress", "--temperature", "0",
            *ENGINE, "--lora-modules", f"a0={root / 'a0'}"]
    assert main(argv) == 0
    results = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    errors = [json.loads(line) for line in (root / "out.jsonl.errors.jsonl").read_text()
              .splitlines()]
    return root, engine_kwargs(build_parser().parse_args(argv)), results, errors


def test_each_line_gets_its_adapters_output(run, tokenizer_ckpt):
    from qwen_jax import LLM
    root, kwargs, results, _ = run
    loras = [None, LoRARequest("a0", 1, str(root / "a0")), LoRARequest("a1", 2, str(root / "a1"))]
    llm = LLM(str(tokenizer_ckpt[0]), **{**kwargs, "show_progress": False})
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * 3,
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                           lora_request=loras)
    want = [list(o.outputs[0].token_ids) for o in outputs]
    assert len({tuple(w) for w in want}) == 3, "an adapter left the tokens as they were"
    assert [results[k] for k in ("base", "a0", "a1", "a1-again")] == [*want, want[2]]


def test_a_bad_lora_is_reported_with_its_line_and_field(run):
    _, _, results, errors = run
    assert set(results) == {"base", "a0", "a1", "a1-again"}
    by_id = {e["id"]: e for e in errors}
    assert by_id["unknown"]["line"] == 5 and "'lora' 'nope'" in by_id["unknown"]["error"]
    assert by_id["other-path"]["line"] == 6
    assert "'lora.path'" in by_id["other-path"]["error"]
