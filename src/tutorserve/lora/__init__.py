"""LoRA adapters: PEFT-format loading, paging between disk, host RAM and compute slots."""
