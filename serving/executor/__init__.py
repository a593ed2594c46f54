"""Where steps run: scheduler output -> padded model inputs (`model_inputs`), the model
runner that compiles and dispatches the jitted step per (tokens, sequences) bucket
(`model_runner`), host<->device packing, the device KV cache and the host swap store,
multi-host step broadcast, and the step lowered for CUDA without a GPU (`step_lowering`).

Imports `serving.core`, `serving.structured_output` and `serving.sample`.
"""
