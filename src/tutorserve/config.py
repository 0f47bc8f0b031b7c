"""Engine configuration: one slotted dataclass; the LLM facade filters **kwargs through it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True)
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    # The KV cache's storage dtype; auto: the model's (see engine/device.py for CPUs).
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    # KV budget: an explicit block count wins over a byte budget.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int = 1 << 30
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Admission order within a priority, by policy name (engine/policy.py): "cache-aware"
    # (longest cached prefix first, each request passed over at most max_bypass times), "fcfs".
    scheduling: str = "cache-aware"
    max_bypass: int = 32
    seed: int = 0
    num_threads: int | None = None
    # KV tiers below the pool (0 turns a tier off). The disk tier outlives the process; the
    # offline API leaves it off by default, the CLI turns it on.
    kv_ram_bytes: int = 2 << 30
    kv_disk_bytes: int = 0
    kv_disk_dir: str = "~/.cache/tutorserve/kv"
    session_ttl: float = 3600.0  # seconds a session's blocks are kept ahead of other cached KV
    # Multi-LoRA: adapters by name → PEFT folder, loaded at start; more can be loaded later.
    enable_lora: bool = False
    lora_modules: dict[str, str] = dataclasses.field(default_factory=dict)
    max_loras: int = 8  # adapters resident in compute slots (usable in one step)
    max_lora_rank: int = 16
    max_cpu_loras: int = 64  # adapters kept in host RAM; the others are reread from disk

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        cfg = cls(**kwargs)  # type: ignore[arg-type]
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.kv_ram_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("kv_ram_bytes and kv_disk_bytes must be >= 0 (0 turns a tier off)")
        if self.lora_modules and not self.enable_lora:
            self.enable_lora = True
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("max_loras must be >= 1 and max_cpu_loras >= max_loras")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError("max_lora_rank must be in 1..256")
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("kv_disk_dir is required when the disk tier is on")
        if self.session_ttl <= 0:
            raise ValueError("session_ttl must be positive")
        if self.max_bypass < 0:
            raise ValueError("max_bypass must be >= 0")
        for name in ("dtype", "kv_cache_dtype"):
            value = getattr(self, name)
            if value not in ("auto", "float32", "bfloat16", "float16"):
                raise ValueError(f"{name} must be auto, float32, bfloat16 or float16, got {value}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device}")
