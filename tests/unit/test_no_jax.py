"""The host-side serving core must never pull in jax."""

import subprocess
import sys

MODULES = ["serving.request", "serving.page_pool", "serving.kv_cache_manager",
           "serving.scheduler", "serving.buckets", "serving.batch", "serving.config",
           "serving.reasoning", "serving.detokenizer", "serving.output_processor",
           "serving.step_cost", "serving.http_policy", "serving.policies",
           "serving.degradation", "serving.swap", "serving.prefill_cap", "qwen_jax.options",
           "qwen_jax.validation", "qwen_jax.quantization", "serving.tool_parsers",
           "serving.chat_reply",
           "serving.structured", "serving.structured_params", "serving.openai_structured"]


def test_core_modules_do_not_import_jax():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_pure_python_modules_do_not_import_numpy():
    pure = ["serving.request", "serving.page_pool", "serving.kv_cache_manager",
            "serving.scheduler", "serving.buckets", "serving.config", "serving.policies",
            "serving.degradation", "serving.swap", "serving.prefill_cap",
            "serving.tool_parsers", "serving.structured_params", "serving.chat_reply"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in pure)
            + "print('numpy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
