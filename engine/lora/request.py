"""vLLM's offline adapter request: `LLM.generate(..., lora_request=LoRARequest(name, id, path))`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """lora_name: the adapter's served name; lora_int_id: vLLM's id (positive, kept for
    compatibility; baton keys adapters by name); lora_path: its PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest: lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be positive, got {self.lora_int_id}")
