"""The disk tier: one file per KV block under `<dir>/<model fingerprint>/`, kept across restarts.

A file is a fixed header (magic, version, model fingerprint, block hash, session expiry, payload
size, CRC-32 of the payload) and the raw payload. It is written to a temporary name and renamed,
so a crash mid-write leaves no file that looks complete. Every read checks the header against the
key and the running model and the checksum against the payload; a file failing any check is
logged, deleted and reported as a miss, so its bytes never reach attention.

Several processes (engine replicas on one host, or on a shared filesystem) may share the folder.
Each keeps its own index and budget; a lookup that misses it looks for a file another process
wrote and adopts it once its header checks out, and a file another process evicted is a miss.
Temporary names are unique per write and the rename is atomic, so two writers of one block leave
one complete file.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
import zlib
from pathlib import Path

import torch

from tutorserve.engine.kv_tiers.lru import LruTier

log = logging.getLogger(__name__)

_MAGIC = b"TSKV"
_VERSION = 1
_HEADER = struct.Struct("<4sH16s16sdQI")  # magic, version, fingerprint, hash, expiry, size, crc
_EXPIRY_OFFSET = 4 + 2 + 16 + 16
_SUFFIX = ".kvb"
# A temporary file older than this is an interrupted write; a younger one may be another
# process's write in progress, about to be renamed.
_STALE_TMP_S = 600.0


class CorruptBlockError(ValueError):
    """A stored block failed a check; it has been deleted."""


class DiskTier(LruTier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        fingerprint: bytes,
        shape: tuple[int, ...],
        dtype: torch.dtype,
    ) -> None:
        self.fingerprint = fingerprint
        self.dir = Path(root).expanduser() / fingerprint.hex()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot use {root} as the KV disk tier folder: {e}") from e
        self.shape = shape
        self.dtype = dtype
        self.payload_bytes = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
        super().__init__(capacity_bytes)
        self._lock = threading.Lock()
        self._scan()

    def _path(self, key: bytes) -> Path:
        return self.dir / (key.hex() + _SUFFIX)

    def _scan(self) -> None:
        """Index the files in the folder (this process's last run's, or other processes'),
        oldest use first; drop leftovers of interrupted writes and files whose header does not
        belong here."""
        found = []
        for path in self.dir.iterdir():
            try:
                if path.suffix != _SUFFIX:
                    if path.name.endswith(".tmp") and _age(path) > _STALE_TMP_S:
                        path.unlink(missing_ok=True)
                    continue
                key = bytes.fromhex(path.stem)
                header = self._read_header(path, key)
                found.append((path.stat().st_mtime, key, header[4]))
            except FileNotFoundError:  # renamed or evicted by another process meanwhile
                continue
            except (ValueError, OSError) as e:
                self._drop(path, e)
        # Session entries must enter in expiry order, the others in last-use order.
        for _, key, expires_at in sorted(found, key=lambda f: f[2] or f[0]):
            self.index.add(key, _HEADER.size + self.payload_bytes, expires_at)
        for key in self.index.victims(0):
            self._remove(key)
        if found:
            log.info(
                "KV disk tier: %d blocks (%.1f MiB) in %s",
                len(self.index),
                self.index.used_bytes / 2**20,
                self.dir,
            )

    def _read_header(self, path: Path, key: bytes) -> tuple:
        with path.open("rb") as f:
            return self._check_header(f.read(_HEADER.size), key, os.fstat(f.fileno()).st_size)

    def _check_header(self, raw: bytes, key: bytes, file_size: int) -> tuple:
        if len(raw) < _HEADER.size:
            raise CorruptBlockError("truncated header")
        header = _HEADER.unpack(raw)
        magic, version, fingerprint, block_hash, _, size, _ = header
        if magic != _MAGIC or version != _VERSION:
            raise CorruptBlockError("not a tutorserve KV block file")
        if fingerprint != self.fingerprint:
            raise CorruptBlockError("written for another model or KV layout")
        if block_hash != key:
            raise CorruptBlockError("holds another block")
        if size != self.payload_bytes or file_size != _HEADER.size + size:
            raise CorruptBlockError(f"size {file_size} B, expected {_HEADER.size + size} B")
        return header

    def _drop(self, path: Path, error: Exception) -> None:
        self.stats.errors += 1
        log.error("KV disk tier: dropping %s (%s); the block will be recomputed", path.name, error)
        path.unlink(missing_ok=True)

    def _remove(self, key: bytes) -> None:
        self.index.remove(key)
        self._path(key).unlink(missing_ok=True)

    def _admit(self, key: bytes, expires_at: float) -> None:
        """Count a block's file in this process's budget, evicting others to make room."""
        nbytes = _HEADER.size + self.payload_bytes
        with self._lock:
            for victim in self.index.victims(nbytes):
                self._remove(victim)
            self.index.add(key, nbytes, expires_at)

    def has(self, key: bytes) -> bool:
        """Whether the block is stored: in this process's index, or in a file another process
        wrote (adopted into the index if its header checks out; a bad file is a miss)."""
        if key in self.index:
            return True
        path = self._path(key)
        try:
            header = self._read_header(path, key)
        except FileNotFoundError:
            return False
        except (ValueError, OSError) as e:
            self._drop(path, e)
            return False
        self._admit(key, header[4])
        return True

    def put(self, key: bytes, data: torch.Tensor, expires_at: float = 0.0) -> None:
        """Write a block (disk writer thread); an existing one only has its expiry extended."""
        if self.touch(key, expires_at):
            return
        nbytes = _HEADER.size + self.payload_bytes
        if nbytes > self.index.capacity_bytes:
            self.stats.dropped += 1
            return
        payload = data.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header = _HEADER.pack(
            _MAGIC, _VERSION, self.fingerprint, key, expires_at, len(payload), zlib.crc32(payload)
        )
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with tmp.open("wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._admit(key, expires_at)
        self.stats.bytes_in += nbytes

    def touch(self, key: bytes, expires_at: float = 0.0) -> bool:
        """Mark a stored block used (extending its session expiry on disk too); False if absent."""
        with self._lock:
            entry = self.index.get(key)
            if entry is None:
                return False
            extend = expires_at > entry.expires_at
            self.index.touch(key, expires_at)
        try:
            if extend:
                with self._path(key).open("r+b") as f:
                    f.seek(_EXPIRY_OFFSET)
                    f.write(struct.pack("<d", expires_at))
            else:
                os.utime(self._path(key))
        except FileNotFoundError:
            with self._lock:
                self.index.remove(key)
            return False
        return True

    def get(self, key: bytes) -> torch.Tensor | None:
        """Read and verify a block (disk reader thread); None if absent or dropped as corrupt.
        A file another process wrote is read too, and adopted."""
        path = self._path(key)
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                raw = bytearray(size)
                f.readinto(raw)
            view = memoryview(raw)
            header = self._check_header(bytes(view[: _HEADER.size]), key, size)
            if zlib.crc32(view[_HEADER.size :]) != header[6]:
                raise CorruptBlockError("checksum mismatch")
        except FileNotFoundError:
            with self._lock:
                self.index.remove(key)
            return None
        except (CorruptBlockError, OSError) as e:
            with self._lock:
                self.index.remove(key)
            self._drop(path, e)
            return None
        with self._lock:
            known = key in self.index
            self.index.touch(key)
        if not known:
            self._admit(key, header[4])
        self.stats.bytes_out += size
        tensor = torch.frombuffer(raw, dtype=torch.uint8, offset=_HEADER.size)
        return tensor.view(self.dtype).view(self.shape)


def _age(path: Path) -> float:
    return time.time() - path.stat().st_mtime
