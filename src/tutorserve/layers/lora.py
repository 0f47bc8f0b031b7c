"""Multi-LoRA projections: one base matmul for the whole batch, plus each token's adapter update
computed for all adapters at once as segmented (grouped) matmuls — Punica's SGMV idea.

Adapters live in a fixed number of slots. Each wrapped projection holds, per slot, A stacked
[slots, in, parts × R] (all fused sub-projections, e.g. q, k and v, side by side) and one B per
sub-projection [slots, R, out_part], zero-padded to the largest rank R, so adapters of mixed
ranks and targets share one batch. Per step, the tokens that use an adapter are gathered in slot
order; shrink (x·A) and expand (·B) are one grouped matmul each over those segments, and the
result is added into the sub-projection's slice of the base output.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from tutorserve.layers.attention.context import current_context

GATHER_ROWS = 128  # steps up to this many tokens gather weights per row; larger ones segment


@dataclass(slots=True)
class LoRABatch:
    """Which tokens of the step use an adapter, grouped by the adapter's slot: the rows of one
    slot are contiguous, so each slot's low-rank product is one segment of a grouped matmul.
    The model runner builds it each step and puts it in the step context."""

    rows: torch.Tensor  # [n] token rows using an adapter, ordered by slot
    offsets: torch.Tensor  # [num_slots] int32 end of each slot's segment in `rows`
    counts: list[int]  # rows per slot
    slots: list[int]  # the slots with rows this step (few: the step's distinct adapters)
    row_slots: torch.Tensor  # [num_tokens] each token's slot; num_slots (a zero slot) if none
    single: int | None  # the slot, when every token of the step uses that one adapter


def segment_mm(x: torch.Tensor, w: torch.Tensor, batch: LoRABatch) -> torch.Tensor:
    """Rows of `x` in segment s times `w[s]`: [n, in] × [slots, in, out] → [n, out]."""
    if x.is_cpu and _aligned(x, w):
        return torch._grouped_mm(x, w, offs=batch.offsets)
    # Elsewhere (grouped GEMM on CUDA needs recent GPUs and alignments): one matmul per slot
    # that has rows, still not one per request.
    parts, start = [], 0
    for slot in batch.slots:
        n = batch.counts[slot]
        parts.append(x[start : start + n] @ w[slot])
        start += n
    return torch.cat(parts)


def _aligned(*tensors: torch.Tensor) -> bool:
    """The CPU grouped matmul wants every stride but the last a multiple of 16 bytes."""
    return all(
        all(st * t.element_size() % 16 == 0 for st in t.stride()[:-1]) and t.stride(-1) == 1
        for t in tensors
    )


class LoRALinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        parts: list[tuple[str, int]],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`base`: a linear with `in_features` (plain, or quantized: the low-rank part stays in
        the activations' `dtype` either way); `parts`: the fused output's sub-projections in
        order, as (PEFT name, out features)."""
        super().__init__()
        self.base = base
        self.names = [name for name, _ in parts]
        self.rank = -(-max_rank // 8) * 8  # keeps every stride 16-byte aligned
        # Buffers, not parameters: state, not weights (the KV fingerprint samples weights).
        self.register_buffer(
            "lora_a",
            torch.zeros(num_slots + 1, base.in_features, len(parts) * self.rank, dtype=dtype,
                        device=device),
        )  # fmt: skip
        for j, (_, size) in enumerate(parts):
            b = torch.zeros(num_slots + 1, self.rank, size, dtype=dtype, device=device)
            self.register_buffer(f"lora_b{j}", b)
        ends = list(accumulate(size for _, size in parts))
        self.spans = list(zip([0, *ends[:-1]], ends, strict=True))
        # Slots holding an adapter that targets this module. The extra last slot stays zero:
        # tokens without an adapter gather it.
        self.used = [False] * num_slots

    def lora_b(self, j: int) -> torch.Tensor:
        return getattr(self, f"lora_b{j}")

    def set_slot(self, slot: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Load one adapter's (A [r, in], B [out, r]) per sub-projection into `slot`; absent
        sub-projections stay zero."""
        self.lora_a[slot].zero_()
        r = self.rank
        for j, name in enumerate(self.names):
            self.lora_b(j)[slot].zero_()
            if name in weights:
                a, b = weights[name]
                k = a.shape[0]
                self.lora_a[slot, :, j * r : j * r + k] = a.t()
                self.lora_b(j)[slot, :k] = b.t()
        self.used[slot] = bool(weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        ctx = current_context()
        batch: LoRABatch | None = None if ctx is None else ctx.lora
        if batch is None or not any(self.used[s] for s in batch.slots):
            return out
        r = self.rank
        if batch.single is not None:  # one adapter for every token: plain matmuls
            h = x @ self.lora_a[batch.single]
            for j, (start, end) in enumerate(self.spans):
                out[:, start:end] += h[:, j * r : (j + 1) * r] @ self.lora_b(j)[batch.single]
        elif x.shape[0] <= GATHER_ROWS:
            # Decode-sized steps: each row gathers its own adapter's weights (Punica's BGMV);
            # rows without one gather the zero slot. Cheaper than sorting rows into segments.
            slots = batch.row_slots
            h = torch.bmm(x.unsqueeze(1), self.lora_a[slots])
            for j, (start, end) in enumerate(self.spans):
                delta = torch.bmm(h[:, :, j * r : (j + 1) * r], self.lora_b(j)[slots])
                out[:, start:end] += delta.squeeze(1)
        else:  # prefill-sized: one grouped matmul over each adapter's segment of rows (SGMV)
            h = segment_mm(x.index_select(0, batch.rows), self.lora_a[:-1], batch)
            for j, (start, end) in enumerate(self.spans):
                delta = segment_mm(h[:, j * r : (j + 1) * r], self.lora_b(j)[:-1], batch)
                out[:, start:end].index_add_(0, batch.rows, delta)
        return out
