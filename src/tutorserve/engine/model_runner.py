"""Turns a scheduled batch into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from tutorserve.config import EngineConfig
from tutorserve.engine.logits_process import (
    constrain_drafts,
    logprobs_of,
    process_logits,
    token_logprobs,
)
from tutorserve.engine.outputs import TokenLogprob
from tutorserve.engine.sampler import sample, verify
from tutorserve.engine.scheduler import SchedulerOutput
from tutorserve.engine.sequence import Sequence
from tutorserve.layers.attention import AttentionBatch, PrefillSpan, StepContext, select_backend
from tutorserve.layers.attention.context import reset_context, set_context
from tutorserve.layers.lora import LoRABatch
from tutorserve.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)
_PROMPT_LOGITS_ROWS = 256


@dataclass(slots=True)
class StepResult:
    """What a step computed: the requests that sampled (`seqs`), their new tokens (one, or for
    a row that verified drafts, the drafts the model agreed with and one more of its own), the
    log-probabilities of each one's new token if its request asked (rows with drafts never
    ask), and those of the prompt tokens this step computed, for requests that asked."""

    seqs: list[Sequence]
    tokens: list[list[int]]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: list[tuple[Sequence, list[TokenLogprob]]]


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model: LlamaForCausalLM,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        eos_token_ids: list[int],
    ) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids  # banned before a request's min_tokens
        self.block_size = config.block_size
        self.device = device
        self.dtype = dtype
        self.k_cache, self.v_cache = model.allocate_kv_cache(
            num_blocks, config.block_size, kv_dtype, device
        )
        self.generator = torch.Generator(device=device).manual_seed(config.seed)
        # Cascade attention merges a course prompt's part with each row's own by log-sum-exp,
        # which rounds otherwise than the row's keys in one pass: under batch invariance a row
        # reads its whole context itself.
        self.share_prefixes = config.enable_prefix_caching and not config.batch_invariant
        self.backend = select_backend(
            device, dtype, kv_dtype, model.config.head_dim, config.block_size
        )
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
    def run(self, batch: SchedulerOutput) -> StepResult:
        """Compute every scheduled token; sample for requests whose known tokens are now all
        computed."""
        input_ids, positions, ctx, logit_rows, samplers, prompt_rows = self._prepare(batch)
        start = time.perf_counter()
        set_context(ctx)
        try:
            hidden = self.model(input_ids, positions)
        finally:
            reset_context()
        logits = self.model.compute_logits(hidden[logit_rows]) if samplers else None
        self.last_forward_s = time.perf_counter() - start
        result = StepResult(samplers, [], [], self._prompt_logprobs(hidden, prompt_rows))
        if logits is None:
            return result
        drafted = any(s.spec_token_ids for s in samplers)
        plain = [i for i, s in enumerate(samplers) if not s.spec_token_ids]
        result.tokens = [[] for _ in samplers]
        result.logprobs = [None] * len(samplers)
        if drafted:
            rows = np.cumsum([0] + [1 + len(s.spec_token_ids) for s in samplers])
        if plain:  # one logit row each
            seqs = [samplers[i] for i in plain]
            plain_logits = process_logits(
                logits[rows[plain]] if drafted else logits, seqs, self.eos_token_ids
            )
            picked = sample(plain_logits, seqs, self.generator)
            for i, tok, lp in zip(
                plain, picked, token_logprobs(plain_logits, seqs, picked), strict=True
            ):
                result.tokens[i], result.logprobs[i] = [tok], lp
        if drafted:
            for i, seq in enumerate(samplers):
                if seq.spec_token_ids:
                    row = constrain_drafts(logits[rows[i] : rows[i + 1]], seq)
                    result.tokens[i] = verify(row, seq, self.generator)
        return result

    def _prompt_logprobs(
        self, hidden: torch.Tensor, prompt_rows: list[tuple[Sequence, list[int], list[int]]]
    ) -> list[tuple[Sequence, list[TokenLogprob]]]:
        """Each (request, hidden rows, next prompt tokens): the log-probabilities of those
        tokens, from the model's own logits (no penalties: they shape what is generated). A few
        hundred rows at a time: a long prompt's full logits would not fit in memory."""
        out = []
        for seq, rows, targets in prompt_rows:
            entries: list[TokenLogprob] = []
            for j in range(0, len(rows), _PROMPT_LOGITS_ROWS):
                logits = self.model.compute_logits(hidden[rows[j : j + _PROMPT_LOGITS_ROWS]])
                entries += logprobs_of(logits, targets[j : j + _PROMPT_LOGITS_ROWS],
                                       seq.params.prompt_logprobs)  # fmt: skip
            out.append((seq, entries))
        return out

    def _prepare(self, batch: SchedulerOutput) -> tuple[
        torch.Tensor, torch.Tensor, StepContext, torch.Tensor, list[Sequence],
        list[tuple[Sequence, list[int], list[int]]],
    ]:  # fmt: skip
        bs, dev = self.block_size, self.device
        ids: list[int] = []
        pos_parts, slot_parts = [], []
        attn = AttentionBatch(bs, dev, self.dtype, [], [], [], [], self.share_prefixes)
        logit_rows: list[int] = []
        samplers: list[Sequence] = []
        prompt_rows = []  # (request, rows, next prompt tokens) for prompt log-probabilities
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
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                last = min(end, seq.num_prompt_tokens - 1)  # the prompt's last predicts an output
                rows = list(range(offset, offset + last - start))
                prompt_rows.append((seq, rows, seq.token_ids[start + 1 : last + 1]))
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
            prompt_rows,
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
