"""Orbax round trips (checkpoint.save, and `qwen-jax convert`) give bit-identical logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from qwen_jax import Qwen3ForCausalLM, checkpoint
from qwen_jax.config import ModelConfig
from serving.cli.main import main
from tests.model.conftest import logits


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_orbax_round_trip_gives_bit_identical_logits(tmp_path, hf_checkpoint, reference_logits):
    src, _ = hf_checkpoint
    (src / "tokenizer.json").write_text('{"fake": "tokenizer"}')
    model = Qwen3ForCausalLM.from_pretrained(src)
    out = checkpoint.save(model, tmp_path / "orbax", source_dir=src)
    assert checkpoint.is_orbax_checkpoint(out)
    assert (out / "tokenizer.json").read_text() == '{"fake": "tokenizer"}'
    assert ModelConfig.from_hf(out) == model.config
    restored = Qwen3ForCausalLM.from_pretrained(out)
    jax.tree.map(np.testing.assert_array_equal, _params(restored), _params(model))
    np.testing.assert_array_equal(np.asarray(restored.rope_inv_freq[...]),
                                  np.asarray(model.rope_inv_freq[...]))
    np.testing.assert_array_equal(logits(restored), reference_logits)


def test_unknown_load_format_raises(tmp_path, hf_checkpoint):
    src, _ = hf_checkpoint
    with pytest.raises(ValueError, match="load_format"):
        Qwen3ForCausalLM.from_pretrained(src, load_format="pickle")


def test_convert_cli_round_trip_gives_bit_identical_logits(tmp_path, capsys, hf_checkpoint,
                                                           reference_logits):
    src, _ = hf_checkpoint
    out = tmp_path / "converted"
    assert main(["convert", "--model", str(src), "--output", str(out)]) == 0
    summary = capsys.readouterr().out.strip().splitlines()
    assert len(summary) == 1 and "params" in summary[0] and " s" in summary[0]
    num_params = sum(x.size for x in jax.tree.leaves(_params(
        Qwen3ForCausalLM.from_pretrained(src))))
    assert f"{num_params:,}" in summary[0]
    assert (out / "generation_config.json").exists()  # tokenizer-side files are copied
    np.testing.assert_array_equal(logits(Qwen3ForCausalLM.from_pretrained(out)), reference_logits)


def test_convert_cli_bfloat16_saves_bf16_params(tmp_path, hf_checkpoint):
    src, _ = hf_checkpoint
    out = tmp_path / "converted_bf16"
    assert main(["convert", "--model", str(src), "--output", str(out), "--dtype", "bfloat16"]) == 0
    # dtype=None keeps the saved dtype
    restored = checkpoint.restore(out, model_cls=Qwen3ForCausalLM)
    assert {x.dtype for x in jax.tree.leaves(_params(restored))} == {jnp.dtype(jnp.bfloat16)}
    as_f32 = Qwen3ForCausalLM.from_pretrained(out, dtype="float32")
    assert {x.dtype for x in jax.tree.leaves(_params(as_f32))} == {jnp.dtype(jnp.float32)}
    loaded = Qwen3ForCausalLM.from_pretrained(src, dtype="bfloat16")
    jax.tree.map(np.testing.assert_array_equal, _params(restored), _params(loaded))


def test_convert_cli_rejects_missing_arguments(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["convert", "--model", "qwen3-0.6b"])
    assert excinfo.value.code == 2
    assert "--output" in capsys.readouterr().err
