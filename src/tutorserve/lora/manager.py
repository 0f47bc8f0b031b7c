"""Adapter paging: registered adapters live on disk, a bounded number in host RAM (LRU), and at
most `max_loras` in the compute slots that a step can use (S-LoRA's unified paging, by whole
adapter). A slot is taken when a request using its adapter is admitted and held while any
running request uses it; an unheld slot is reused least recently used first."""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from torch import nn

from tutorserve.layers.lora import LoRALinear
from tutorserve.lora.adapter import LoRAAdapter, load_adapter
from tutorserve.models.config import ModelConfig

log = logging.getLogger(__name__)


def wrap_model(
    model: nn.Module, num_slots: int, max_rank: int
) -> dict[tuple[int, str], LoRALinear]:
    """Put a LoRALinear around every projection the model's class declares targetable; returns
    them by (layer, module)."""
    cfg: ModelConfig = model.config  # type: ignore[assignment]
    packed = model.arch.packed(cfg)  # type: ignore[attr-defined]
    activations = model.norm.weight  # type: ignore[attr-defined]  # the model's dtype, device
    out = {}
    for i, layer in enumerate(model.layers):  # type: ignore[attr-defined]
        for path, parts in packed.items():
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            wrapped = LoRALinear(
                getattr(parent, name), parts, num_slots, max_rank, activations.dtype,
                activations.device,
            )  # fmt: skip
            setattr(parent, name, wrapped)
            out[i, name] = wrapped
    return out


class LoRAManager:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_cpu_loras: int) -> None:
        self.base: ModelConfig = model.config  # type: ignore[assignment]
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.modules = wrap_model(model, max_loras, max_rank)
        self.paths: dict[str, Path] = {}
        self.fingerprints: dict[str, bytes] = {}
        self.ram: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[str | None] = [None] * max_loras
        self.refs = [0] * max_loras
        self.last_used = [0] * max_loras  # a tick per acquire: least recently used slot goes
        self._tick = 0
        self.num_slot_loads = 0
        self.num_disk_loads = 0
        # Disk → host RAM reads start when a request arrives, ahead of its scheduling.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="lora-read")
        self._reading: dict[str, Future[LoRAAdapter]] = {}

    @property
    def num_slots(self) -> int:
        return len(self.slots)

    def names(self) -> list[str]:
        return list(self.paths)

    def add(self, name: str, path: str | Path) -> LoRAAdapter:
        if not name or name in self.paths:
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded" if name
                             else "a LoRA adapter needs a name")  # fmt: skip
        adapter = load_adapter(name, path, self.base, self.max_rank)
        self.paths[name] = adapter.path
        self.fingerprints[name] = adapter.fingerprint
        self._keep_in_ram(adapter)
        log.info("LoRA adapter %s: rank %d, %d projections, from %s", name, adapter.rank,
                 len(adapter.weights), adapter.path)  # fmt: skip
        return adapter

    def remove(self, name: str) -> None:
        if name not in self.paths:
            raise KeyError(name)
        if name in self.slots:
            slot = self.slots.index(name)
            if self.refs[slot]:
                raise ValueError(f"LoRA adapter {name!r} is in use by running requests")
            self.slots[slot] = None
        del self.paths[name], self.fingerprints[name]
        self.ram.pop(name, None)
        self._reading.pop(name, None)

    def acquire(self, name: str) -> int | None:
        """A slot holding `name` for one more request, loading it if needed; None when every
        slot is held by running requests of other adapters."""
        if name in self.slots:
            slot = self.slots.index(name)
        else:
            idle = [s for s in range(self.num_slots) if not self.refs[s]]
            if not idle:
                return None
            # Empty slots first, then the least recently used.
            slot = min(idle, key=lambda s: (self.slots[s] is not None, self.last_used[s]))
            self._load(slot, name)
        self.refs[slot] += 1
        self._tick += 1
        self.last_used[slot] = self._tick
        return slot

    def prefetch(self, name: str) -> None:
        """Start reading `name` back into host RAM if it was paged out (a request for it just
        arrived), so that taking a slot later is a memory copy. At most a step's worth of
        adapters are read ahead, which bounds the RAM they hold outside `max_cpu_loras`."""
        if name in self.ram or name in self._reading or name in self.slots:
            return
        if len(self._reading) >= self.num_slots:
            return  # read when its request is admitted instead
        self._reading[name] = self._reader.submit(
            load_adapter, name, self.paths[name], self.base, self.max_rank
        )

    def release(self, slot: int) -> None:
        self.refs[slot] -= 1

    def _load(self, slot: int, name: str) -> None:
        adapter = self.ram.get(name)
        if adapter is None:  # paged out of host RAM: use the prefetch, or read it now
            reading = self._reading.pop(name, None)
            if reading is not None:
                adapter = reading.result()
            else:
                adapter = load_adapter(name, self.paths[name], self.base, self.max_rank)
            self.num_disk_loads += 1
        self._keep_in_ram(adapter)
        for (layer, _), wrapped in self.modules.items():
            weights = {}
            for proj in wrapped.names:
                if (layer, proj) in adapter.weights:
                    a, b = adapter.weights[layer, proj]
                    dev, dt = wrapped.lora_a.device, wrapped.lora_a.dtype
                    weights[proj] = (a.to(dev, dt), b.to(dev, dt))
            wrapped.set_slot(slot, weights)
        self.slots[slot] = name
        self.num_slot_loads += 1

    def _keep_in_ram(self, adapter: LoRAAdapter) -> None:
        self.ram[adapter.name] = adapter
        self.ram.move_to_end(adapter.name)
        while len(self.ram) > self.max_cpu_loras:
            self.ram.popitem(last=False)
