"""The engine loop: schedule → run the model → turn sampled tokens into outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from tutorserve.config import EngineConfig
from tutorserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from tutorserve.engine.device import resolve_device, resolve_dtype, resolve_kv_dtype
from tutorserve.engine.kv_cache_manager import KVCacheManager
from tutorserve.engine.kv_tiers import TieredKVStore, model_fingerprint
from tutorserve.engine.model_runner import ModelRunner
from tutorserve.engine.outputs import RequestMetrics, RequestOutput, TokenLogprob
from tutorserve.engine.scheduler import Scheduler
from tutorserve.engine.sequence import Sequence, SequenceStatus
from tutorserve.engine.stats import EngineStats, SpecCounters
from tutorserve.engine.step_log import StepLogFile, StepRecord
from tutorserve.lora.manager import LoRAManager
from tutorserve.models.loader import load_model, load_model_config
from tutorserve.quant.layers import dequantizing_rows, keep_on_blocks
from tutorserve.sampling_params import SamplingParams
from tutorserve.spec import DraftProposer, Proposer, draft_model_name, proposer_named, scope_key
from tutorserve.spec.backoff import backoff_named
from tutorserve.structured import GrammarCompiler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    """Text state of one request: full detokenized text and how much has been handed out."""

    detok: IncrementalDetokenizer
    holdback: int  # chars withheld from streaming while they might start a stop string
    sent: int = 0


def check_prompt(ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """ValueError for a prompt an engine of this context and vocabulary cannot take."""
    if not ids:
        raise ValueError("prompt is empty")
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt has {len(ids)} tokens; the maximum context length is "
            f"{max_model_len} and at least one token must be generated"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"prompt token ids must lie in [0, {vocab_size}): {bad} is outside the vocabulary"
        )


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.kv_dtype = resolve_kv_dtype(
            config.kv_cache_dtype, config.dtype, self.dtype, self.device
        )
        # A wrong proposer name fails before the model loads.
        spec = config.speculative
        draft = draft_model_name(spec) if spec else None
        self.proposer: Proposer | None = proposer_named(spec) if spec and not draft else None
        self.backoff = backoff_named(
            config.speculative_backoff, config.speculative_disable_by_batch_size
        )
        self.model, self.tokenizer = load_model(
            config.model, self.dtype, self.device, config.quantization
        )
        if config.batch_invariant:
            keep_on_blocks(self.model)
        bs, kv_size = config.block_size, torch.finfo(self.kv_dtype).bits // 8
        per_token = self.model.config.kv_bytes_per_token(kv_size)
        if draft:  # a draft model's KV has as many blocks, out of the same byte budget
            per_token += load_model_config(draft).kv_bytes_per_token(kv_size)
        per_block = per_token * bs
        num_blocks = config.num_kv_blocks or config.kv_cache_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV budget {config.kv_cache_bytes} B is below one block ({per_block} B)"
            )
        self.max_model_len = self._max_model_len(num_blocks * bs)
        self.runner = ModelRunner(
            config,
            self.model,
            num_blocks,
            self.device,
            self.dtype,
            self.kv_dtype,
            self.tokenizer.eos_token_ids,
        )
        self.store = self._kv_store()
        self.kv = KVCacheManager(num_blocks, bs, config.enable_prefix_caching, self.store)
        self.lora = self._lora_manager()
        self.scheduler = Scheduler(config, self.kv, self.lora)
        self.grammars = GrammarCompiler(self.tokenizer, self.model.config.vocab_size)
        if draft:
            self.proposer = DraftProposer.load(
                draft, self.tokenizer, self.model.config.vocab_size, self.max_model_len,
                num_blocks, bs, self.dtype, self.kv_dtype, self.device,
            )  # fmt: skip
        if self.proposer is not None:
            self.max_drafts = config.num_speculative_tokens or self.proposer.max_drafts
        self.spec = SpecCounters()
        self.seqs: dict[str, Sequence] = {}
        self._streams: dict[str, _Stream] = {}
        # A list records one StepRecord per step (benchmarks, profiling); a file writes them.
        self.step_log: list[StepRecord] | StepLogFile | None = None
        if config.step_log_dir:
            header = {"model": config.model, "dtype": config.dtype, "threads": config.num_threads,
                      "block_size": bs, "max_num_batched_tokens": config.max_num_batched_tokens,
                      "dequant_rows": dequantizing_rows(self.model, self.dtype)}  # fmt: skip
            self.step_log = StepLogFile(config.step_log_dir, header)
        self.num_steps, self.step_seconds = 0, 0.0
        # When the last logged step ended with requests left: the time until the next step
        # starts is the serving loop's, not idle time.
        self._busy_end: float | None = None

    def _lora_manager(self) -> LoRAManager | None:
        cfg = self.config
        if not cfg.enable_lora:
            return None
        manager = LoRAManager(self.model, cfg.max_loras, cfg.max_lora_rank, cfg.max_cpu_loras)
        self.runner.num_lora_slots = cfg.max_loras
        for name, path in cfg.lora_modules.items():
            manager.add(name, path)
        return manager

    # ---- LoRA adapters ------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT adapter under `name` (ValueError if invalid or the name is taken)."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled (start with --enable-lora)")
        self.lora.add(name, path)

    def unload_lora(self, name: str) -> None:
        if self.lora is None or name not in self.lora.paths:
            raise KeyError(name)
        if any(seq.lora == name for seq in self.seqs.values()):
            raise ValueError(f"LoRA adapter {name!r} has requests in flight")
        self.lora.remove(name)

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else self.lora.names()

    def _kv_store(self) -> TieredKVStore | None:
        cfg = self.config
        if not (cfg.kv_ram_bytes or cfg.kv_disk_bytes):
            return None
        if not cfg.enable_prefix_caching:
            log.warning("KV tiers are keyed by prefix-cache hashes: off without prefix caching")
            return None
        return TieredKVStore(
            self.runner.k_cache,
            self.runner.v_cache,
            ram_bytes=cfg.kv_ram_bytes,
            disk_bytes=cfg.kv_disk_bytes,
            disk_dir=cfg.kv_disk_dir,
            fingerprint=model_fingerprint(
                self.model, self.kv_dtype, cfg.block_size, self.runner.backend.kv_layout
            ),
            session_ttl=cfg.session_ttl,
            session_write_through=cfg.session_write_through,
        )

    def reset_prefix_cache(self) -> int:
        """Empty the pool's prefix cache (its blocks spill to the KV tiers, as under pressure);
        returns the number of blocks dropped. For benchmarks of cold starts."""
        return self.kv.pool.evict_cached()

    def stats(self) -> EngineStats:
        """A snapshot for metrics: queues, KV blocks, prefix-cache and tier counters."""
        kv, pool, sched = self.kv, self.kv.pool, self.scheduler
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_blocks=pool.num_blocks,
            kv_blocks_used=kv.num_used_blocks,
            kv_blocks_free=pool.num_free,
            kv_blocks_cached=pool.num_cached_free,
            prefix_query_tokens=kv.prefix_query_tokens,
            prefix_hit_tokens=kv.prefix_hit_tokens,
            num_preemptions=sched.num_preemptions,
            tiers=() if self.store is None else tuple(t.snapshot() for t in self.store.tiers),
            spec=self.spec.copy(),
            num_steps=self.num_steps,
            step_seconds=self.step_seconds,
        )

    def on_idle(self) -> None:
        """Nothing to step: a good moment for the KV tiers' deferred disk writes."""
        if self.store is not None:
            self.store.flush()

    def close(self) -> None:
        """Finish the KV tiers' pending disk writes (so a restart finds them)."""
        if self.store is not None:
            self.store.close()
        if isinstance(self.step_log, StepLogFile):
            self.step_log.close()

    def _max_model_len(self, capacity: int) -> int:
        limit = self.model.config.max_position_embeddings
        want = self.config.max_model_len
        if want is not None:
            if want > limit:
                raise ValueError(f"max_model_len {want} exceeds the model's context {limit}")
            if want > capacity:
                raise ValueError(f"max_model_len {want} exceeds the KV budget of {capacity} tokens")
            return want
        if capacity < limit:
            log.warning("KV budget holds %d tokens: max_model_len lowered from %d", capacity, limit)
        return min(limit, capacity)

    # ---- requests -----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        session_id: str | None = None,
        lora: str | None = None,
        spec_scope: str | None = None,
    ) -> Sequence:
        """Queue a request. `spec_scope` names the requests whose outputs its drafts may come
        from (speculative decoding; default: those whose prompts start alike)."""
        params = params or SamplingParams()
        params.validate()
        if request_id in self.seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(ids)
        params.check_vocab(self.model.config.vocab_size)
        salt = self.check_lora(lora)
        seq = Sequence(
            request_id, ids, params, prompt=text, priority=priority, session_id=session_id
        )
        seq.lora, seq.cache_salt = lora, salt
        if params.structured is not None:
            seq.matcher = self.grammars.matcher(params.structured)
        seq.spec_scope = scope_key(ids, spec_scope, salt)
        if lora is not None:
            self.lora.prefetch(lora)  # type: ignore[union-attr]
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        holdback = max((len(s) for s in params.stop), default=1) - 1
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        self._streams[request_id] = _Stream(detok, holdback)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check_lora(self, lora: str | None) -> bytes:
        """The cache salt of adapter `lora` (no KV is shared across adapters)."""
        if lora is None:
            return b""
        if self.lora is None:
            raise ValueError(f"LoRA adapter {lora!r} requested but LoRA is not enabled")
        if lora not in self.lora.fingerprints:
            raise ValueError(f"unknown LoRA adapter {lora!r}; loaded: {self.lora.names()}")
        return self.lora.fingerprints[lora]

    def check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.model.config.vocab_size)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self._finish(seq, "abort", time.monotonic())
        return self._output(seq, "")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduling step; outputs of the requests that produced a token in it."""
        start, started_at = time.perf_counter(), time.time()
        drafted = self.proposer is not None and self._draft()
        batch = self.scheduler.schedule()
        failed = [self._fail(seq) for seq in self.scheduler.failed]
        if self.proposer is not None:
            for seq in batch.preempted:
                self.proposer.release(seq.request_id)
        self.scheduler.failed.clear()
        if not batch.seqs:
            if failed:
                return failed
            if self.store is not None:  # maybe everyone waits on disk reads: don't spin
                self.store.wait_for_reads(timeout=0.01)
            return []
        used_blocks, running = self.kv.num_used_blocks, len(self.scheduler.running)
        shape = batch.shape() if self.step_log is not None else None
        num_drafts = sum(len(s.spec_token_ids) for s in batch.seqs) if drafted else 0
        # The back-off learns from decode-only steps: a prefill's cost is not the drafts'.
        timed_for_backoff = self.proposer is not None and all(
            n == 1 + len(seq.spec_token_ids)
            for seq, n in zip(batch.seqs, batch.num_tokens, strict=True)
        )
        result = self.runner.run(batch)
        now = time.monotonic()
        for seq, entries in result.prompt_logprobs:
            # A request preempted and recomputed computes its prompt again: keep the first.
            seq.prompt_logprobs += entries[
                max(0, len(seq.prompt_logprobs) - seq.num_computed_tokens) :
            ]
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            # A row's drafts count as computed once verified, below.
            seq.num_computed_tokens += n - len(seq.spec_token_ids)
            self.kv.cache_computed_blocks(seq)
        outputs = [
            self._emit(seq, toks, lp, now)
            for seq, toks, lp in zip(result.seqs, result.tokens, result.logprobs, strict=True)
        ]
        outputs += failed
        if timed_for_backoff:
            self.backoff.observe(len(batch.seqs), num_drafts, time.perf_counter() - start,
                                 sum(len(t) for t in result.tokens))  # fmt: skip
        elapsed = time.perf_counter() - start
        self.num_steps += 1
        self.step_seconds += elapsed
        if self.step_log is not None:
            self.step_log.append(
                StepRecord(
                    num_seqs=len(batch.seqs),
                    num_tokens=batch.total_tokens,
                    all_decode=batch.total_tokens == len(batch.seqs),
                    step_s=elapsed,
                    forward_s=self.runner.last_forward_s,
                    num_running=running,
                    num_used_blocks=used_blocks,
                    shape=shape,
                    gap_s=None if self._busy_end is None else start - self._busy_end,
                    started_at=started_at,
                    num_draft_tokens=num_drafts,
                )
            )
            self._busy_end = time.perf_counter() if self.has_unfinished() else None
        return outputs

    def _emit(
        self, seq: Sequence, tokens: list[int], logprob: TokenLogprob | None, now: float
    ) -> RequestOutput:
        """Append a step's tokens to `seq` (one, or verified drafts and one more) and give the
        request's output; a row that verified drafts keeps their KV, and gives back the blocks
        it took for the rejected ones."""
        drafts = len(seq.spec_token_ids)
        seq.spec_token_ids = []
        if logprob is not None:
            seq.logprobs.append(logprob)
        out = self._append(seq, tokens, now)
        if self.proposer is not None:
            self.proposer.observe(seq.request_id, seq.spec_scope, seq.token_ids,
                                  seq.num_prompt_tokens)  # fmt: skip
        if drafts:
            self.spec.record(drafts, len(tokens) - 1)
            self.proposer.feedback(seq.request_id, seq.spec_scope, drafts, len(tokens) - 1)
            if not seq.is_finished:
                seq.num_computed_tokens += len(tokens) - 1
                self.kv.cache_computed_blocks(seq)
                self.kv.trim(seq)
        return out

    def _draft(self) -> bool:
        """Ask the back-off whether this step drafts, for as many requests as it will hold (those
        running and, up to `max_num_seqs`, those waiting: a step that admits a request is as
        busy as its batch, not as the one before it), and draft if so."""
        sched = self.scheduler
        batch = min(len(sched.running) + len(sched.waiting), self.config.max_num_seqs)
        drafted = self.backoff.should_draft(batch)
        if drafted:
            self._propose()
        return drafted

    def _propose(self) -> None:
        """Drafts for the next step's decode rows."""
        running = self.scheduler.running
        rows, seqs = [], []
        for seq in running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not seq.params.draftable:
                continue  # still prefilling, or its logits are processed row by row
            # Drafts and the token after them must fit max_tokens and the context.
            room = min(
                self.max_drafts,
                seq.params.max_tokens - seq.num_output_tokens - 1,
                self.max_model_len - seq.num_tokens - 1,
            )
            if room > 0:
                rows.append((seq.request_id, seq.spec_scope, seq.token_ids, room))
                seqs.append(seq)
        if rows:
            for seq, drafts in zip(seqs, self.proposer.propose_batch(rows), strict=True):
                if seq.matcher is not None:  # drafts the grammar refuses could never be kept
                    drafts = drafts[: seq.matcher.valid_prefix(drafts)]
                seq.spec_token_ids = drafts

    def _append(self, seq: Sequence, tokens: list[int], now: float) -> RequestOutput:
        p = seq.params
        stream = self._streams[seq.request_id]
        if seq.first_token_time is None:
            seq.first_token_time = now
        reason = None
        for token in tokens:
            seq.token_ids.append(token)
            if seq.matcher is not None:
                seq.matcher.accept(token)
            if token in p.stop_token_ids or (
                not p.ignore_eos and token in self.tokenizer.eos_token_ids
            ):
                reason = "stop"
            else:
                new = stream.detok.add(token)
                cut = find_stop(stream.detok.text, len(new), p.stop)
                if cut != -1:
                    stream.detok.text = stream.detok.text[:cut]
                    reason = "stop"
            if reason is None and seq.matcher is not None and seq.matcher.done:
                reason = "stop"  # the grammar allows nothing more: no step just for the EOS
            if reason is None and (
                seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
            ):
                reason = "length"
            if reason is not None:
                break
        text = stream.detok.text
        if reason is not None:
            self._finish(seq, reason, now)
            end = len(text)
        else:
            end = max(stream.sent, len(text) - stream.holdback)
        delta = text[stream.sent : end]
        stream.sent = end
        return self._output(seq, delta)

    def _fail(self, seq: Sequence) -> RequestOutput:
        """End a request the scheduler could not serve (finish reason "abort")."""
        self._finish(seq, "abort", time.monotonic())
        return self._output(seq, "")

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = now
        self.scheduler.remove(seq)
        del self.seqs[seq.request_id]
        if self.proposer is not None:
            self.proposer.release(seq.request_id)

    def _output(self, seq: Sequence, delta: str) -> RequestOutput:
        stream = self._streams[seq.request_id]
        text = stream.detok.text if seq.is_finished else stream.detok.text[: stream.sent]
        if seq.is_finished:
            del self._streams[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=text,
            token_ids=seq.output_token_ids,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            metrics=RequestMetrics(
                arrival_time=seq.arrival_time,
                first_token_time=seq.first_token_time,
                finish_time=seq.finish_time,
                num_prompt_tokens=seq.num_prompt_tokens,
                num_cached_tokens=max(seq.num_cached_tokens, 0),
                num_output_tokens=seq.num_output_tokens,
                num_preemptions=seq.num_preemptions,
            ),
            delta_text=delta,
            logprobs=None if seq.params.logprobs is None else list(seq.logprobs),
            prompt_logprobs=None if seq.params.prompt_logprobs is None else seq.prompt_logprobs,
        )
