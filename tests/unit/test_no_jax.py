"""The host-side serving core must never pull in jax."""

import subprocess
import sys

MODULES = ["serving.core.request", "serving.core.page_pool", "serving.core.kv_cache_manager",
           "serving.core.scheduler", "serving.core.buckets", "serving.executor.model_inputs", "serving.core.config",
           "serving.parsers.reasoning", "serving.engine.detokenizer", "serving.engine.output_processor",
           "serving.metrics.step_cost", "serving.entrypoints.openai.http_policy", "serving.core.policies",
           "serving.core.degradation", "serving.core.swap", "serving.core.prefill_cap", "qwen_jax.options",
           "qwen_jax.validation", "qwen_jax.quantization", "serving.parsers.tool_parsers",
           "serving.parsers.chat_reply",
           "serving.structured_output.grammar", "serving.core.structured_params", "serving.entrypoints.openai.structured_requests"]


def test_core_modules_do_not_import_jax():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in MODULES)
            + "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "[]"


def test_pure_python_modules_do_not_import_numpy():
    pure = ["serving.core.request", "serving.core.page_pool", "serving.core.kv_cache_manager",
            "serving.core.scheduler", "serving.core.buckets", "serving.core.config", "serving.core.policies",
            "serving.core.degradation", "serving.core.swap", "serving.core.prefill_cap",
            "serving.parsers.tool_parsers", "serving.core.structured_params", "serving.parsers.chat_reply"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in pure)
            + "print('numpy' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True)
    assert result.stdout.strip() == "False"
