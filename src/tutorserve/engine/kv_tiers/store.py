"""The tiered KV store: what the engine's block pool evicts spills to RAM, RAM spills to disk, and
a prefix lookup that misses the pool is served from RAM, or from disk by way of RAM.

The engine thread only ever copies between the pool and RAM (memory speed). Disk reads run on a
reader thread that promotes a run of blocks into RAM while the request waits and others keep
stepping; disk writes run on a writer thread behind a bounded backlog (a write that would exceed it
is skipped, never waited for). Blocks of a finished session turn are written through to both
tiers with an expiry (the session TTL), so the next turn, even after a restart, finds them.

With `session_write_through`, a session's blocks are queued for disk as soon as they are kept,
not when the engine idles: replicas sharing the disk folder then find a session whose replica
died or was scaled away, even one that was busy until it went.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path

import torch
from torch import nn

from tutorserve.engine.kv_tiers.disk import DiskTier
from tutorserve.engine.kv_tiers.ram import RamTier

log = logging.getLogger(__name__)
# With no RAM tier, disk reads still land in RAM first: this much is kept for them.
_STAGING_BYTES = 256 << 20
_MAX_WRITE_BACKLOG = 512 << 20
_MAX_DISK_READS_PER_REQUEST = 2  # then compute: bounds a request's wait under RAM thrashing


def model_fingerprint(model: nn.Module, dtype: torch.dtype, block_size: int, layout: str) -> bytes:
    """Identifies the KV a model produces: its config, the cache dtype, block size and layout
    (the attention backend's `kv_layout`), and a sample of every weight (names, shapes and
    strided values), so two checkpoints of one architecture never share stored blocks. Cheap
    enough to run at every start."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((getattr(model, "config", None), str(dtype), block_size, layout)).encode())
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
            h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.digest()


@dataclass(slots=True)
class TierMatch:
    """Blocks below the pool that continue a request's cached prefix."""

    keys: list[bytes] = field(default_factory=list)
    payloads: list[torch.Tensor] = field(default_factory=list)  # held, so eviction can't race
    pending: bool = False  # the next block is on its way from disk: wait for it
    ram_missed: bool = False  # RAM did not hold the whole cacheable prompt before disk reads
    disk_missed: bool = False  # neither did the disk


class TieredKVStore:
    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        *,
        ram_bytes: int,
        disk_bytes: int,
        disk_dir: str | Path,
        fingerprint: bytes,
        session_ttl: float,
        session_write_through: bool = False,
    ) -> None:
        layers, kv_heads, _, block_size, head_dim = k_cache.shape
        self.k_cache, self.v_cache = k_cache, v_cache
        self.shape = (2, layers, kv_heads, block_size, head_dim)
        self.session_ttl = session_ttl
        self.session_write_through = session_write_through
        self.spill_to_ram = ram_bytes > 0
        self.ram = RamTier(ram_bytes if ram_bytes > 0 else _STAGING_BYTES)
        self.disk = (
            DiskTier(disk_dir, disk_bytes, fingerprint, self.shape, k_cache.dtype)
            if disk_bytes > 0
            else None
        )
        self._lock = threading.Lock()
        self._reading: dict[bytes, Future | None] = {}  # None: the read is being submitted
        self._from_disk: set[bytes] = set()  # in RAM because a disk read put them there
        self._reads_by_request: dict[str, int] = {}
        self._backlog = 0
        self._unsaved: dict[bytes, float] = {}  # session blocks in RAM, not yet on disk
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")

    @property
    def tiers(self) -> list[RamTier | DiskTier]:
        out: list[RamTier | DiskTier] = [self.ram] if self.spill_to_ram else []
        return out + ([self.disk] if self.disk is not None else [])

    # ---- called on the engine thread -------------------------------------------------------
    def spill(self, blocks: list[tuple[int, bytes]]) -> None:
        """The pool is about to reuse these cached blocks: keep their KV below it."""
        self._store(blocks, expires_at=0.0)

    def keep_session(self, blocks: list[tuple[int, bytes]]) -> None:
        """A session turn ended: keep its blocks in the tiers, ahead of other KV for the TTL."""
        self._store(blocks, expires_at=time.time() + self.session_ttl)

    def _store(self, blocks: list[tuple[int, bytes]], expires_at: float) -> None:
        """Copy blocks out of the pool. With a RAM tier they go there, and a session's blocks
        are written back to disk later (when RAM evicts them, when the engine idles, at close;
        at once with `session_write_through`): a disk writer busy during steps takes the GIL
        from the step loop. Without one, they go straight to disk."""
        wanted = []
        for block_id, key in blocks:
            if self.spill_to_ram:
                if not self.ram.touch(key, expires_at):
                    wanted.append((block_id, key))
                if expires_at and self.disk is not None:
                    with self._lock:
                        self._unsaved[key] = expires_at
            elif key not in self.disk:  # type: ignore[operator]
                wanted.append((block_id, key))
            elif expires_at:
                self._write_down(key, None, expires_at)
        payloads = self._copy_out([block_id for block_id, _ in wanted]) if wanted else []
        for (_, key), data in zip(wanted, payloads, strict=True):
            if self.spill_to_ram:
                for victim in self.ram.put(key, data, expires_at):
                    self._write_down(*victim)
            else:
                self._write_down(key, data, expires_at)
        if expires_at and self.session_write_through:
            self.flush()

    def flush(self) -> None:
        """Queue the disk writes of session blocks held only in RAM (the engine is idle)."""
        with self._lock:
            unsaved, self._unsaved = self._unsaved, {}
        for key, expires_at in unsaved.items():
            data = self.ram.peek(key)
            if data is not None:
                self._write_down(key, data, expires_at)

    def wait_written(self, keys: list[bytes], timeout: float) -> bool:
        """Whether `keys` are all on disk once the disk writes queued so far are done (or
        `timeout` passed: never waits longer). With `session_write_through`, a session's
        blocks are queued as its request ends. The writer runs writes in order, so a no-op
        queued behind them marks their end; a write skipped for the backlog is no write to wait
        for, and its key only makes the answer False. Called from any thread (the prefill side
        of prefill/decode disaggregation, after its request ended)."""
        if self.disk is None:
            return False
        try:
            wait([self._writer.submit(lambda: None)], timeout=timeout)
        except RuntimeError:  # the writer is shut down: the store is closing
            return False
        return all(self.disk.has(k) for k in keys)

    def _copy_out(self, block_ids: list[int]) -> list[torch.Tensor]:
        return [
            torch.stack((self.k_cache[:, :, b], self.v_cache[:, :, b])).cpu() for b in block_ids
        ]

    def match(self, request_id: str, keys: list[bytes]) -> TierMatch:
        """The leading `keys` held in RAM; if the next one is on disk, start reading the run of
        them that is (the request should wait: `pending`)."""
        out = TierMatch()
        for key in keys:
            data = self.ram.get(key)
            if data is None:
                break
            out.keys.append(key)
            out.payloads.append(data)
        rest = keys[len(out.keys) :]
        if rest and self.disk is not None:
            with self._lock:
                out.pending = rest[0] in self._reading
            if not out.pending and self.disk.has(rest[0]):
                out.pending = self._start_read(request_id, rest)
        with self._lock:
            promoted = any(k in self._from_disk for k in out.keys)
        out.ram_missed = bool(rest) or promoted
        out.disk_missed = bool(rest) and not out.pending and self.disk is not None
        return out

    def _start_read(self, request_id: str, keys: list[bytes]) -> bool:
        disk = self.disk
        assert disk is not None
        reads = self._reads_by_request.get(request_id, 0)
        if reads >= _MAX_DISK_READS_PER_REQUEST:
            return False
        self._reads_by_request[request_id] = reads + 1
        # At most half of RAM per read, so what it brings in is still there when restored.
        room = self.ram.capacity_bytes // 2 // disk.payload_bytes
        run = list(takewhile(disk.has, keys[:room]))
        # Registered before the read starts, so it cannot finish (and unregister them) first:
        # a key left behind would keep its request waiting forever.
        with self._lock:
            self._reading.update(dict.fromkeys(run))
        future = self._reader.submit(self._read, run)
        with self._lock:
            for key in run:
                if key in self._reading:
                    self._reading[key] = future
        return True

    def restore(self, match: TierMatch, block_ids: list[int]) -> None:
        """Copy matched payloads into pool blocks (allocated by the caller)."""
        start = time.perf_counter()
        data = torch.stack(match.payloads).to(self.k_cache.device)  # [n, 2, L, H, B, D]
        index = torch.as_tensor(block_ids, device=self.k_cache.device)
        self.k_cache.index_copy_(2, index, data[:, 0].permute(1, 2, 0, 3, 4))
        self.v_cache.index_copy_(2, index, data[:, 1].permute(1, 2, 0, 3, 4))
        with self._lock:
            from_disk = sum(1 for k in match.keys if k in self._from_disk)
            self._from_disk.difference_update(match.keys)
        stats = self.ram.stats
        stats.hits += len(match.keys) - from_disk
        stats.bytes_out += data.numel() * data.element_size()
        stats.loads += 1
        stats.load_seconds += time.perf_counter() - start

    def finish_request(self, request_id: str, match: TierMatch | None) -> None:
        """Count a finished lookup's misses once per request, not once per waiting step."""
        self._reads_by_request.pop(request_id, None)
        if match is None:
            return
        if self.spill_to_ram and match.ram_missed:
            self.ram.stats.misses += 1
        if self.disk is not None and match.disk_missed:
            self.disk.stats.misses += 1

    def wait_for_reads(self, timeout: float) -> None:
        """Sleep until a disk read finishes (or `timeout`), when nothing else can run."""
        with self._lock:
            futures = {f for f in self._reading.values() if f is not None}
        if futures:
            wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """Write what sessions still hold only in RAM, and stop the threads: a restart then
        finds every session's history on disk."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
        if self.disk is None:
            return
        with self._lock:
            unsaved, self._unsaved = self._unsaved, {}
        for key, expires_at in unsaved.items():
            if (data := self.ram.peek(key)) is not None:
                self.disk.put(key, data, expires_at)

    # ---- disk threads --------------------------------------------------------------------------
    def _read(self, keys: list[bytes]) -> None:
        disk = self.disk
        assert disk is not None
        start, done = time.perf_counter(), 0
        try:
            for key in keys:
                data = disk.get(key)
                if data is None:
                    break
                for victim in self.ram.put(key, data):
                    self._write_down(*victim)
                with self._lock:
                    self._from_disk.add(key)
                done += 1
        finally:
            with self._lock:
                for key in keys:
                    self._reading.pop(key, None)
            stats = disk.stats
            stats.hits += done
            stats.loads += 1
            stats.load_seconds += time.perf_counter() - start

    def _write_down(self, key: bytes, data: torch.Tensor | None, expires_at: float) -> None:
        """Queue a block for disk (`data` None: only extend the stored one's session expiry),
        unless the writer's backlog is full: then skip it rather than stall the caller."""
        disk = self.disk
        if disk is None:
            return
        cost = 0 if data is None else disk.payload_bytes
        with self._lock:
            self._unsaved.pop(key, None)
            if self._backlog + cost > _MAX_WRITE_BACKLOG:
                disk.stats.dropped += 1
                return
            self._backlog += cost

        def run() -> None:
            try:
                if data is None:
                    disk.touch(key, expires_at)
                else:
                    disk.put(key, data, expires_at)
            except OSError:
                log.exception("KV disk tier: writing a block failed")
            finally:
                with self._lock:
                    self._backlog -= cost

        self._writer.submit(run)
