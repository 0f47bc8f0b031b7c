"""Chained block hashes: the prefix cache's keys."""

from __future__ import annotations

import hashlib
from array import array


def hash_block(parent: bytes, tokens: list[int], salt: bytes = b"") -> bytes:
    """Chained block hash: equal hashes mean equal whole prefixes, not just equal blocks.

    A stable digest (not Python's `hash`) so keys stay valid across processes and restarts.
    """
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(salt)
    h.update(array("i", tokens).tobytes())
    return h.digest()


def extend_block_hashes(
    hashes: list[bytes], tokens: list[int], block_size: int, salt: bytes = b""
) -> list[bytes]:
    """Append to `hashes` (those of the leading full blocks so far) the chained hashes of the
    rest of `tokens`' full blocks; returns `hashes`."""
    while len(hashes) < len(tokens) // block_size:
        i = len(hashes)
        parent = hashes[-1] if hashes else b""
        hashes.append(hash_block(parent, tokens[i * block_size : (i + 1) * block_size], salt))
    return hashes
