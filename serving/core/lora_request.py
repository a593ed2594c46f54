"""vLLM's LoRARequest: which adapter a request runs with. Pure Python."""

from __future__ import annotations

import dataclasses

from qwen_jax.validation import require


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name (what requests and `/v1/models` call it), a unique positive id,
    and its directory (a PEFT `adapter_config.json` + `adapter_model.safetensors`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        require(isinstance(self.lora_name, str) and bool(self.lora_name), "lora_name",
                self.lora_name, "a non-empty string")
        require(isinstance(self.lora_int_id, int) and self.lora_int_id > 0, "lora_int_id",
                self.lora_int_id, "a positive int (vLLM's ids start at 1)")
        object.__setattr__(self, "lora_path", str(self.lora_path))
