"""Draft-model speculation: a smaller model with the target's tokenizer drafts the next tokens
greedily, over its own paged KV cache (`--speculative draft:<model>`).

The draft keeps, per request, the tokens whose K/V it has written. Each proposal first rolls
that back to the longest prefix the request's tokens still share (the engine kept some drafts
and rejected the rest), computes what the request gained since (its prompt, the first time, in
chunks), then decodes `k` tokens one at a time. Greedy drafts are a deterministic function of
the request's tokens, so verification (`engine/sampler.py: verify`, rejection sampling with a
one-hot draft distribution) keeps the target's output exact, greedy or sampled, and the draft
draws no random numbers: seeded runs stay reproducible.

Its KV lives in its own pool of blocks, as many as the target's, the engine's KV byte budget
split between the two (`engine.py`): every token the target can hold, the draft can too. The
pool is not shared with the target's because the target's blocks are admitted, preempted and
prefix-cached by the scheduler, while the draft's may be dropped at any time at no cost to
exactness. vLLM and SGLang instead give the draft the target's block tables; that saves the
second allocator but ties the draft to the scheduler's accounting.

The pool caches prefixes as the target's does (`paging.BlockPool`, full blocks of a request's
own tokens keyed by their chained hashes): a class's students share the course prompt, which
the draft then computes once, not once per student. The draft has no adapters (it drafts for
every adapter as the base model), so its blocks carry no salt.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from tutorserve.layers.attention import AttentionBatch, PrefillSpan, StepContext, select_backend
from tutorserve.layers.attention.context import reset_context, set_context
from tutorserve.models.config import ModelConfig
from tutorserve.models.llama import LlamaForCausalLM
from tutorserve.models.loader import load_model
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.paging import BlockPool, extend_block_hashes
from tutorserve.spec.proposer import AcceptanceAverage, Proposer

log = logging.getLogger(__name__)
_CHUNK = 512  # tokens per forward when the draft catches up on a prompt


@dataclass(slots=True)
class _DraftKV:
    """One request's K/V in the draft's cache: `tokens[i]` is written at position i; the first
    `fixed` of them are the request's own (never rolled back), the rest are drafts. `hashes`:
    those of the full blocks of its own tokens, the first `published` of them in the cache;
    `accepted`: how many of its drafts the model has been keeping, which bounds the next."""

    tokens: list[int] = field(default_factory=list)
    fixed: int = 0
    table: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    published: int = 0
    accepted: AcceptanceAverage = field(default_factory=AcceptanceAverage)


class DraftProposer(Proposer):
    def __init__(
        self,
        model: LlamaForCausalLM,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """`vocab_size`: the target's; the draft never proposes an id beyond it. `dtype`: the
        model's activations (its parameters may be quantized blocks, stored as bytes)."""
        self.model, self.vocab_size, self.block_size = model, vocab_size, block_size
        self.dtype, self.device = dtype, device
        self.k_cache, self.v_cache = model.allocate_kv_cache(
            num_blocks, block_size, kv_dtype, self.device
        )
        self.backend = select_backend(
            self.device, self.dtype, kv_dtype, model.config.head_dim, block_size
        )
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, _DraftKV] = {}
        self.cached_tokens = 0  # prompt tokens found in the cache, not computed again
        self.workspace: dict[str, torch.Tensor] = {}
        log.info(
            "draft KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks,
            block_size,
            2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20,
        )

    @classmethod
    def load(
        cls,
        name: str,
        target_tokenizer: Tokenizer,
        target_vocab: int,
        max_model_len: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
    ) -> DraftProposer:
        """The draft model `name` (resolved as `--model` is: a registered name, a HF folder or
        a GGUF file); ValueError unless it shares the target's vocabulary and context."""
        model, tokenizer = load_model(name, dtype, device, "auto")
        check_draft(name, tokenizer, model.config, target_tokenizer, target_vocab, max_model_len)
        return cls(model, target_vocab, num_blocks, block_size, dtype, kv_dtype, device)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def propose(self, request: str, scope: bytes, tokens: list[int], k: int) -> list[int]:
        return self.propose_batch([(request, scope, tokens, k)])[0]

    def propose_batch(self, rows: list[tuple[str, bytes, list[int], int]]) -> list[list[int]]:
        """All rows' drafts together: one forward for what each row gained since its last
        proposal, then one per draft position (a row drops out once it has its `k`)."""
        drafts: list[list[int]] = [[] for _ in rows]
        live: list[tuple[int, _DraftKV, int]] = []
        catch_up: list[tuple[_DraftKV, list[int]]] = []
        for i, (request, _, tokens, k) in enumerate(rows):
            if k <= 0:
                continue
            kv = self._rollback(request, tokens)
            k = kv.accepted.draft_length(k)
            if not kv.table:
                self._match_prefix(kv, tokens)
            # Positions up to len(tokens) + k - 2 are written: the last draft's K/V is not read.
            if not self._reserve(kv, len(tokens) + k - 1):
                # No drafts this step (speculation is optional); the blocks come back as
                # requests end.
                log.debug("draft KV pool full: no drafts for %s", request)
                continue
            while len(tokens) - len(kv.tokens) > _CHUNK:  # a long prompt, the first time
                self._forward([(kv, tokens[len(kv.tokens) : len(kv.tokens) + _CHUNK])])
            kv.fixed = len(tokens)
            live.append((i, kv, k))
            catch_up.append((kv, tokens[len(kv.tokens) :]))
        if not live:
            return drafts
        picks = self._greedy(self._forward(catch_up))
        for _, kv, _ in live:
            self._publish(kv)
        while live:
            for (i, _, _), pick in zip(live, picks, strict=True):
                drafts[i].append(pick)
            live = [(i, kv, k) for i, kv, k in live if len(drafts[i]) < k]
            if live:
                picks = self._greedy(self._forward([(kv, drafts[i][-1:]) for i, kv, _ in live]))
        return drafts

    def feedback(self, request: str, scope: bytes, drafted: int, accepted: int) -> None:
        kv = self.requests.get(request)
        if kv is not None:
            kv.accepted.record(accepted)

    def release(self, request: str) -> None:
        kv = self.requests.pop(request, None)
        if kv is not None:
            self.pool.release(list(reversed(kv.table)))

    def _match_prefix(self, kv: _DraftKV, tokens: list[int]) -> None:
        """Start a request with no KV from the cached blocks of its leading tokens (short of
        the last, whose logits the drafting needs)."""
        extend_block_hashes(kv.hashes, tokens, self.block_size)
        kv.table = self.pool.cached_prefix(kv.hashes[: (len(tokens) - 1) // self.block_size])
        self.pool.touch(kv.table)
        kv.published = len(kv.table)
        kv.fixed = len(kv.table) * self.block_size
        kv.tokens = tokens[: kv.fixed]
        self.cached_tokens += kv.fixed

    def _publish(self, kv: _DraftKV) -> None:
        """Put the request's full blocks of its own tokens, now written, in the cache."""
        extend_block_hashes(kv.hashes, kv.tokens[: kv.fixed], self.block_size)
        for i in range(kv.published, len(kv.hashes)):
            self.pool.register(kv.table[i], kv.hashes[i])
        kv.published = len(kv.hashes)

    def _reserve(self, kv: _DraftKV, num_tokens: int) -> bool:
        """Blocks for `num_tokens` positions, no more: ones past them (rejected drafts') go
        back. False, changing nothing, when the pool cannot give enough."""
        need = -(-num_tokens // self.block_size)
        extra = need - len(kv.table)
        if extra > self.pool.num_free:
            return False
        if extra < 0:  # blocks of drafts only: those of the request's own tokens come first
            self.pool.release(list(reversed(kv.table[need:])))
            del kv.table[need:]
        else:
            kv.table += self.pool.allocate(extra)
        return True

    def _rollback(self, request: str, tokens: list[int]) -> _DraftKV:
        """The request's draft KV, cut to the longest prefix of `tokens` it holds (the drafts
        the engine kept), and short of the last token, whose logits the drafting starts from."""
        kv = self.requests.setdefault(request, _DraftKV())
        keep = min(kv.fixed, len(tokens) - 1)
        while keep < min(len(kv.tokens), len(tokens) - 1) and kv.tokens[keep] == tokens[keep]:
            keep += 1
        del kv.tokens[keep:]
        return kv

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()

    @torch.inference_mode()
    def _forward(self, rows: list[tuple[_DraftKV, list[int]]]) -> torch.Tensor:
        """Write the K/V of each row's new tokens after its cached ones; the logits at each
        row's last, in the rows' order. One-token rows go first, as attention wants them."""
        bs, dev = self.block_size, self.device
        order = sorted(range(len(rows)), key=lambda r: len(rows[r][1]) > 1)
        attn = AttentionBatch(bs, dev, self.dtype, [], [], None, [], False)
        ids: list[int] = []
        pos_parts, slot_parts, last = [], [], np.empty(len(rows), dtype=np.int64)
        for r in order:
            kv, new = rows[r]
            start, end = len(kv.tokens), len(kv.tokens) + len(new)
            table, pos = kv.table[: -(-end // bs)], np.arange(start, end)
            if len(new) == 1:
                attn.decode_tables.append(table)
                attn.decode_lens.append(end)
            else:
                attn.prefills.append(PrefillSpan(len(ids), len(ids) + len(new), start, table))
            ids.extend(new)
            last[r] = len(ids) - 1
            pos_parts.append(pos)
            slot_parts.append(np.asarray(table)[pos // bs] * bs + pos % bs)
            kv.tokens.extend(new)
        set_context(
            StepContext(
                slot_mapping=torch.as_tensor(np.concatenate(slot_parts), device=dev),
                backend=self.backend,
                attention=self.backend.build(attn),
                workspace=self.workspace,
            )
        )
        try:
            hidden = self.model(
                torch.as_tensor(ids, device=dev),
                torch.as_tensor(np.concatenate(pos_parts), device=dev),
            )
        finally:
            reset_context()
        return self.model.compute_logits(hidden[torch.as_tensor(last, device=dev)])


def check_draft(
    name: str,
    tokenizer: Tokenizer,
    config: ModelConfig,
    target_tokenizer: Tokenizer,
    target_vocab: int,
    max_model_len: int,
) -> None:
    """ValueError unless the draft reads and writes the target's token ids, over its context.
    Its embedding may have more rows than the target's (checkpoints pad them differently), not
    fewer: every id the target may see or emit must be one the draft can read."""
    if tokenizer.backend.get_vocab() != target_tokenizer.backend.get_vocab():
        raise ValueError(
            f"draft model {name!r} has another vocabulary than the target's "
            f"({tokenizer.vocab_size} vs {target_tokenizer.vocab_size} tokens): a draft must "
            "share the target's tokenizer"
        )
    if config.vocab_size < target_vocab:
        raise ValueError(
            f"draft model {name!r} embeds {config.vocab_size} token ids, fewer than the "
            f"target's {target_vocab}"
        )
    max_positions = config.max_position_embeddings
    if max_positions < max_model_len:
        raise ValueError(
            f"draft model {name!r} holds {max_positions} positions, below max_model_len "
            f"{max_model_len}: lower --max-model-len or pick another draft"
        )
