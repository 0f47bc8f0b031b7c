"""What a step's attention needs: the runner's view of the step (`AttentionBatch`), and the
decode layout every backend shares — padded block tables, and the groups of rows that share a
cached prefix (for cascade attention)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

Prefill = TypeVar("Prefill")


@dataclass(slots=True)
class PrefillSpan:
    """One request computing several tokens this step (a whole prompt or a chunk of it)."""

    start: int  # offset of its first query token in the flattened batch
    end: int
    first_pos: int  # position of its first token: the tokens before it are in the KV cache
    table: list[int]  # its blocks, through this chunk

    @property
    def context_len(self) -> int:
        """Tokens in KV after this step, this chunk included."""
        return self.first_pos + self.end - self.start


@dataclass(slots=True)
class AttentionBatch:
    """A step as the model runner sees it, before any backend lays it out: the one-token
    (decode) rows, which come first in the flattened batch, then the prefill chunks."""

    block_size: int
    device: torch.device
    dtype: torch.dtype  # the queries' (the model's)
    decode_tables: list[list[int]]  # each decode row's blocks, covering its context
    decode_lens: list[int]  # tokens in each decode row's context, the new one included
    decode_hashes: list[list[bytes]] | None  # chained block hashes per row (None: unknown)
    prefills: list[PrefillSpan]
    share_prefixes: bool  # group decode rows by shared cached prefix (prefix caching on)


@dataclass(slots=True)
class SharedPrefixGroups:
    """Decode rows whose block tables start with the same cached blocks (students of one
    course). Attention over that shared prefix is computed once per group for all its queries,
    then merged with each row's own suffix by log-sum-exp (cascade attention)."""

    tables: torch.Tensor  # [groups, max_prefix_blocks] shared prefix blocks, padded
    bias: torch.Tensor | None  # [groups, 1, max_prefix_blocks * block_size]; None: no padding
    rows: torch.Tensor  # [groups, max_members] decode row of each member, padded with 0
    member_slots: torch.Tensor  # [grouped_rows] flat (group, member) index of each grouped row
    grouped_rows: torch.Tensor  # [grouped_rows] decode row index
    # Each group's prefix blocks and content hash: equal non-empty keys mean equal gathered
    # K/V (shared blocks are full and computed); () means unknown.
    key: tuple = ()
    lens: torch.Tensor | None = None  # [groups] prefix keys, for reading blocks in place


@dataclass(slots=True)
class DecodeBucket:
    """Decode rows of similar suffix length, padded to one width together (one long history
    must not pad every other row to its length). Attention that reads blocks in place takes
    every row in one bucket with its length instead: padding costs it nothing."""

    rows: torch.Tensor | None  # decode row indices; None = all rows, in order
    tables: torch.Tensor  # [rows, max_blocks] blocks after any shared prefix, padded
    bias: torch.Tensor | None  # [rows, 1, max_blocks * block_size] additive; None: no padding
    lens: torch.Tensor | None = None  # [rows] keys in each row's blocks, for in-place reads


@dataclass(slots=True)
class DecodeBatch:
    """The one-token rows, which come first in the flattened batch."""

    num_rows: int
    buckets: list[DecodeBucket]
    shared: SharedPrefixGroups | None = None


@dataclass(slots=True)
class AttentionMetadata(Generic[Prefill]):
    """What a backend builds once per step for every layer: the decode rows' layout, and each
    prefill chunk in the backend's own form (with `start` and `end` in the flattened batch)."""

    decode: DecodeBatch | None
    prefills: list[Prefill]


def build_decode_batch(batch: AttentionBatch, in_place: bool) -> DecodeBatch:
    """Block tables (covering each row's context) split into shared prefixes and own suffixes.

    Rows share blocks only through the prefix cache, so shared blocks are full and already
    computed; each row's newest token stays in its own suffix. `hashes`: each row's chained
    block hashes, which name a shared prefix's content (its blocks may be reused for other
    content once freed), so attention may keep the prefix K/V it gathered while they match.
    `in_place`: blocks are read where they lie (the CPU kernel), so all rows go in one bucket
    with their lengths, and each shared prefix comes with its length.
    """
    tables, lens, hashes = batch.decode_tables, batch.decode_lens, batch.decode_hashes
    bs, device, dtype = batch.block_size, batch.device, batch.dtype
    shared_blocks = [0] * len(tables)
    groups = _shared_prefix_groups(tables, lens, bs) if batch.share_prefixes else []
    for rows, n in groups:
        for r in rows:
            shared_blocks[r] = n
    suffix = [t[s:] for t, s in zip(tables, shared_blocks, strict=True)]
    suffix_lens = [n - s * bs for n, s in zip(lens, shared_blocks, strict=True)]
    if in_place:
        lens_t = torch.as_tensor(suffix_lens, device=device)
        decode = DecodeBatch(
            len(tables), [DecodeBucket(None, _table_tensor(suffix, device), None, lens_t)]
        )
    else:
        parts = _buckets([len(t) for t in suffix])
        decode = DecodeBatch(len(tables), [])
        for rows in parts:
            tables_b, bias_b = _padded(
                [suffix[r] for r in rows], [suffix_lens[r] for r in rows], bs, device, dtype
            )
            rows_t = None if len(parts) == 1 else torch.as_tensor(rows, device=device)
            decode.buckets.append(DecodeBucket(rows_t, tables_b, bias_b))
    if groups:
        prefixes = [tables[rows[0]][:n] for rows, n in groups]
        prefix_lens = [n * bs for _, n in groups]
        if in_place:  # no padding bias, no reuse key: the kernel reads each prefix's own length
            ptables, pbias = _table_tensor(prefixes, device), None
        else:
            ptables, pbias = _padded(prefixes, prefix_lens, bs, device, dtype)
        width = max(len(rows) for rows, _ in groups)
        members = np.zeros((len(groups), width), dtype=np.int64)
        slots, grouped = [], []
        for g, (rows, _) in enumerate(groups):
            members[g, : len(rows)] = rows
            slots += [g * width + j for j in range(len(rows))]
            grouped += rows
        decode.shared = SharedPrefixGroups(
            tables=ptables,
            bias=pbias,
            rows=torch.as_tensor(members, device=device),
            member_slots=torch.as_tensor(slots, device=device),
            grouped_rows=torch.as_tensor(grouped, device=device),
            key=() if in_place else _prefix_key(tables, hashes, groups),
            lens=torch.as_tensor(prefix_lens, device=device) if in_place else None,
        )
    return decode


def _prefix_key(
    tables: list[list[int]], hashes: list[list[bytes]] | None, groups: list[tuple[list[int], int]]
) -> tuple:
    """Block ids (the layout) and the last block's chained hash (the content) of each group's
    prefix; () when a hash is unknown, which turns reuse off for the step."""
    key = []
    for rows, n in groups:
        lead = rows[0]
        if hashes is None or len(hashes[lead]) < n:
            return ()
        key.append((tuple(tables[lead][:n]), hashes[lead][n - 1]))
    return tuple(key)


def _padded(
    tables: list[list[int]],
    lens: list[int],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tables padded with block 0 to one width, and the [rows, 1, keys] additive attention bias
    (0 for valid keys, -inf for padding), built once per step for every layer; None when every
    row fills the width exactly."""
    table = _table_tensor(tables, device)
    width = table.shape[1]
    if all(n == width * block_size for n in lens):
        return table, None
    keys = torch.arange(width * block_size, device=device)
    lens_t = torch.as_tensor(lens, device=device)
    valid = (keys[None, :] < lens_t[:, None]).view(len(tables), 1, -1)
    bias = torch.zeros(valid.shape, dtype=dtype, device=device).masked_fill_(~valid, float("-inf"))
    return table, bias


def _table_tensor(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """[rows, widest] int64 block tables, padded with block 0."""
    arr = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for r, t in enumerate(tables):
        arr[r, : len(t)] = t
    return torch.as_tensor(arr, device=device)


def _shared_prefix_groups(
    tables: list[list[int]], lens: list[int], bs: int
) -> list[tuple[list[int], int]]:
    """(rows, shared block count) groups. Within rows starting at the same block, the prefix
    length that saves the most reads (length × members) wins; rows that diverge earlier (a
    student who computed part of the prompt itself) are grouped again among themselves rather
    than shortening everyone's shared prefix."""
    by_head: dict[int, list[int]] = {}
    for r, t in enumerate(tables):
        by_head.setdefault(t[0], []).append(r)
    groups = []
    for members in by_head.values():
        while len(members) >= 2:
            leader = tables[members[0]]
            lcp = {}
            for r in members:
                limit, t, n = (lens[r] - 1) // bs, tables[r], 0
                while n < limit and n < len(leader) and t[n] == leader[n]:
                    n += 1
                lcp[r] = n
            best, gain = 0, 0
            for n in set(lcp.values()):
                k = sum(1 for v in lcp.values() if v >= n)
                if k >= 2 and n * k > gain:
                    best, gain = n, n * k
            if not best:
                members = members[1:]
                continue
            groups.append(([r for r in members if lcp[r] >= best], best))
            members = [r for r in members if lcp[r] < best]
    return groups


def _buckets(widths: list[int]) -> list[list[int]]:
    """Rows split by width (blocks) where padding them together would waste over a quarter of
    the gathered keys; otherwise one bucket with rows in their original order."""

    def split(idx: list[int]) -> list[list[int]]:
        cost = len(idx) * widths[idx[-1]]
        best, at = cost, 0
        for i in range(1, len(idx)):
            c = i * widths[idx[i - 1]] + (len(idx) - i) * widths[idx[-1]]
            if c < best:
                best, at = c, i
        if not at or best > 0.75 * cost:
            return [idx]
        return split(idx[:at]) + split(idx[at:])

    parts = split(sorted(range(len(widths)), key=widths.__getitem__))
    return [list(range(len(widths)))] if len(parts) == 1 else parts
