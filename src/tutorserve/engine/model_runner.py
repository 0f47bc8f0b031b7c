"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from tutorserve.config import EngineConfig
from tutorserve.engine.sampler import sample, verify
from tutorserve.engine.scheduler import SchedulerOutput
from tutorserve.engine.sequence import Sequence
from tutorserve.layers.attention import AttentionBatch, PrefillSpan, StepContext, select_backend
from tutorserve.layers.attention.context import reset_context, set_context
from tutorserve.layers.lora import LoRABatch
from tutorserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
    ) -> None:
        self.model = model
        self.block_size = config.block_size
        self.device = device
        cfg = model.config
        shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, config.block_size, cfg.head_dim)
        self.dtype = dtype
        self.k_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=kv_dtype, device=device)
        for i, attn in enumerate(model.attention_layers()):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        self.share_prefixes = config.enable_prefix_caching
        self.backend = select_backend(device, dtype, kv_dtype, cfg.head_dim)
        self.workspace: dict[str, torch.Tensor] = {}
        self.last_forward_s = 0.0
        self.num_lora_slots = 0  # set when LoRA is enabled
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%.1f MiB); model in %s; attention %s",
            num_blocks,
            config.block_size,
            str(kv_dtype).removeprefix("torch."),
            2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20,
            str(dtype).removeprefix("torch."),
            self.backend,
        )

    @torch.inference_mode()
    def run(self, batch: SchedulerOutput) -> tuple[list[Sequence], list[list[int]]]:
        """Compute every scheduled token; sample for requests whose known tokens are now all
        computed. Returns those requests and their new tokens: one, or for a row that verified
        drafts, the drafts the model agreed with and one more of its own."""
        input_ids, positions, ctx, logit_rows, samplers = self._prepare(batch)
        start = time.perf_counter()
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
        logits = self.model.compute_logits(hidden[logit_rows]) if samplers else None
        self.last_forward_s = time.perf_counter() - start
        if logits is None:
            return [], []
        if not any(s.spec_token_ids for s in samplers):  # one logit row each, as usual
            return samplers, [[t] for t in sample(logits, samplers, self.generator)]
        plain = [i for i, s in enumerate(samplers) if not s.spec_token_ids]
        rows = np.cumsum([0] + [1 + len(s.spec_token_ids) for s in samplers])
        out: list[list[int]] = [[] for _ in samplers]
        if plain:
            picked = sample(logits[rows[plain]], [samplers[i] for i in plain], self.generator)
            for i, tok in zip(plain, picked, strict=True):
                out[i] = [tok]
        for i, seq in enumerate(samplers):
            if seq.spec_token_ids:
                out[i] = verify(logits[rows[i] : rows[i + 1]], seq, self.generator)
        return samplers, out

    def _prepare(
        self, batch: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor, list[Sequence]]:
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        attn = AttentionBatch(bs, dev, self.dtype, [], [], [], [], self.share_prefixes)
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        offset = 0
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.token_ids[start:end])
            ids.extend(seq.spec_token_ids)  # the scheduler kept those that fit this step
            pos = np.arange(start, end)
            table = seq.block_table[: -(-end // bs)]
            pos_parts.append(pos)
            slot_parts.append(np.asarray(table)[pos // bs] * bs + pos % bs)
            if n == 1:
                attn.decode_tables.append(table)
                attn.decode_hashes.append(seq.block_hashes)
                attn.decode_lens.append(end)
            else:  # a prefill chunk, or a row with drafts: causal over its own new tokens
                attn.prefills.append(PrefillSpan(offset, offset + n, start, table))
            if end >= seq.num_tokens:  # logits at the last known token and at every draft
                first = offset + seq.num_tokens - 1 - start
                logit_rows.extend(range(first, offset + n))
                samplers.append(seq)
            offset += n
        ctx = StepContext(
            slot_mapping=torch.as_tensor(np.concatenate(slot_parts), device=dev),
            backend=self.backend,
            attention=self.backend.build(attn),
            workspace=self.workspace,
        )
        if self.num_lora_slots:
            ctx.lora = self._lora_batch(batch)
        return (
            torch.as_tensor(ids, device=dev),
            torch.as_tensor(np.concatenate(pos_parts), device=dev),
            ctx,
            torch.as_tensor(logit_rows, device=dev),
            samplers,
        )

    def _lora_batch(self, batch: SchedulerOutput) -> LoRABatch | None:
        """Token rows that use an adapter, grouped by slot (stable, so rows stay in order)."""
        slots = np.repeat([seq.lora_slot for seq in batch.seqs], batch.num_tokens)
        rows = np.flatnonzero(slots >= 0)
        if not len(rows):
            return None
        order = rows[np.argsort(slots[rows], kind="stable")]
        counts = np.bincount(slots[rows], minlength=self.num_lora_slots)
        dev = self.device
        single = int(slots[0]) if len(rows) == len(slots) and (slots == slots[0]).all() else None
        return LoRABatch(
            rows=torch.as_tensor(order, device=dev),
            offsets=torch.as_tensor(np.cumsum(counts), dtype=torch.int32, device=dev),
            counts=counts.tolist(),
            slots=np.flatnonzero(counts).tolist(),
            row_slots=torch.as_tensor(np.where(slots >= 0, slots, self.num_lora_slots), device=dev),
            single=single,
        )
