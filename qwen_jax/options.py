"""The names the model's options accept, one table each. Pure Python (no jax, no numpy), so
the engine configs and the CLI's `--help` can use them without loading jax."""

# Parameter dtypes by name; each is the name of a `jax.numpy` dtype.
PARAM_DTYPES = ("float32", "bfloat16", "float16")

# KV cache dtypes: option name -> `jax.numpy` dtype name ("auto": the model's dtype); the
# one list the config accepts and serving/executor/kv_cache.py allocates from. fp8 pages are written
# and read with unit per-kv-head scales (vLLM's default without calibration); int8 is not
# offered, since unit scales would round every value to an integer.
KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bfloat16", "float16": "float16",
                   "float32": "float32", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                   "fp8_e5m2": "float8_e5m2"}

# Where weights come from: auto (orbax if the directory holds one, else safetensors; dummy
# for a preset name), random (dummy), HF safetensors, or an orbax checkpoint.
LOAD_FORMATS = ("auto", "dummy", "safetensors", "orbax")

# `--quantization`: fp8 and awq read checkpoints of that method (which load quantised
# without the option too); fp8 and int8 quantise a float checkpoint at load; presets
# (dummy weights) take all three. See qwen_jax/quantization.py.
QUANTIZATION_METHODS = ("fp8", "int8", "awq")
