"""The host-side serving core must never pull in jax."""

import subprocess
import sys
from pathlib import Path


def package_modules(*packages: str) -> list[str]:
    """Every module of the named serving subpackages."""
    root = Path(__file__).resolve().parents[2]
    return sorted(".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
                  for package in packages
                  for p in (root / package.replace(".", "/")).rglob("*.py"))


# All of core, parsers and structured output, and the host-side modules of the layers above.
MODULES = [*package_modules("serving.core", "serving.parsers", "serving.structured_output"),
           "serving.executor.model_inputs", "serving.engine.detokenizer",
           "serving.engine.output_processor", "serving.metrics.step_cost",
           "serving.entrypoints.openai.http_policy",
           "serving.entrypoints.openai.structured_requests", "qwen_jax.options",
           "qwen_jax.validation", "qwen_jax.quantization", "qwen_jax.lora",
           "qwen_jax.lora_packing"]


def test_core_modules_do_not_import_jax():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_pure_python_modules_do_not_import_numpy():
    pure = [*package_modules("serving.core"), "serving.parsers.tool_parsers",
            "serving.parsers.chat_reply"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in pure)
            + "print('numpy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
