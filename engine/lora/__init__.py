"""Multi-LoRA serving: PEFT adapters on the base model, many in one batch (engine.lora.layers)."""

from engine.lora.adapter import AdapterInfo, read_adapter
from engine.lora.layers import LoRAModel
from engine.lora.manager import LoRAManager

__all__ = ["AdapterInfo", "LoRAManager", "LoRAModel", "read_adapter"]
