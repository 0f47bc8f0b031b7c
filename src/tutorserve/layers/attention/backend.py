"""The interface every attention backend implements, and the step skeleton they share.

A backend is chosen once, by the model runner (`selector.select_backend`), and owns how the
layers' caches hold K and V (`kv_layout`): it writes each step's new K/V into them (`write`) and
reads them. Each step it turns the runner's `AttentionBatch` into its own metadata (`build`,
once for all layers); each layer then hands it the step's queries (`forward`). The
skeleton is the same for every backend: decode rows first (each over its own suffix blocks,
plus, for rows that share a course prompt, that prefix once per group, merged by log-sum-exp:
cascade attention), then each prefill chunk over its context. Backends differ in how they read
the blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from tutorserve.kernels import paged_attention as kernel
from tutorserve.layers.attention.metadata import (
    AttentionBatch,
    AttentionMetadata,
    DecodeBatch,
    DecodeBucket,
    SharedPrefixGroups,
)


class AttentionLayer(Protocol):
    """What a backend reads of a layer (`PagedAttention`): its shape and its KV cache,
    [kv_heads, blocks, block_size, head_dim] each."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    group: int  # query heads per KV head
    scale: float
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class AttentionBackend(ABC):
    name: str
    # How K and V lie in a block; stored KV (the disk tier's) is kept per layout.
    kv_layout = "rows"

    def write(
        self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """New tokens' k, v [T, kv_heads, dim] into the layer's caches at `slots` [T], in the
        caches' dtype (which may be narrower than the model's)."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        if kernel.supports_write(k, v, k_cache):
            kernel.write_kv(k, v, slots, k_cache, v_cache)
            return
        kvh, dim = layer.num_kv_heads, layer.head_dim
        k_cache.view(kvh, -1, dim).index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
        v_cache.view(kvh, -1, dim).index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))

    @abstractmethod
    def build(self, batch: AttentionBatch) -> AttentionMetadata:
        """This step's metadata, built once and read by every layer."""

    @abstractmethod
    def decode_rows(
        self, layer: AttentionLayer, q: torch.Tensor, bucket: DecodeBucket, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rows, heads, dim] over their own (suffix) blocks → float32 outputs and
        log-sum-exp, [rows, heads, dim] and [rows, heads, 1]."""

    @abstractmethod
    def shared_prefix(
        self, layer: AttentionLayer, qp: torch.Tensor, sp: SharedPrefixGroups, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's queries [groups, members, kv_heads, group, dim] over its shared prefix
        → float32 outputs and log-sum-exp, [groups, members, kv_heads, group, dim or 1]."""

    @abstractmethod
    def prefill(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        chunk: Any, workspace: dict,
    ) -> torch.Tensor:  # fmt: skip
        """A prefill chunk's queries [n, heads, dim] (its fresh k, v [n, kv_heads, dim]) over
        its context, causally → [n, heads, dim] in q's dtype."""

    def release(self, layer: AttentionLayer) -> None:  # noqa: B027  (optional hook)
        """A step without shared prefixes: drop anything kept for them between steps."""

    def forward(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        meta: AttentionMetadata, workspace: dict,
    ) -> torch.Tensor:  # fmt: skip
        """q [T, heads, dim] (k, v [T, kv_heads, dim], already in the cache) → [T, heads, dim]."""
        decode = meta.decode
        nd = 0 if decode is None else decode.num_rows
        if decode is not None and nd == q.shape[0]:
            return self._decode(layer, q, decode, workspace)
        out = torch.empty_like(q)
        if decode is not None:
            out[:nd] = self._decode(layer, q[:nd], decode, workspace)
        for p in meta.prefills:
            s = slice(p.start, p.end)
            out[s] = self.prefill(layer, q[s], k[s], v[s], p, workspace)
        return out

    def _decode(
        self, layer: AttentionLayer, q: torch.Tensor, batch: DecodeBatch, workspace: dict
    ) -> torch.Tensor:
        nd, dim = q.shape[0], layer.head_dim
        if len(batch.buckets) == 1:
            o, lse = self.decode_rows(layer, q, batch.buckets[0], workspace)
        else:
            o = torch.empty(nd, layer.num_heads, dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(nd, layer.num_heads, 1, dtype=torch.float32, device=q.device)
            for bucket in batch.buckets:
                o[bucket.rows], lse[bucket.rows] = self.decode_rows(
                    layer, q[bucket.rows], bucket, workspace
                )
        sp = batch.shared
        if sp is None:
            self.release(layer)
            return o.to(q.dtype)
        ng, members = sp.rows.shape
        qp = q[sp.rows.reshape(-1)].view(ng, members, layer.num_kv_heads, layer.group, dim)
        op, lsep = self.shared_prefix(layer, qp, sp, workspace)
        op = op.reshape(ng * members, layer.num_heads, dim)[sp.member_slots]
        lsep = lsep.reshape(ng * members, layer.num_heads, 1)[sp.member_slots]
        rows = sp.grouped_rows
        os_, lses = o[rows], lse[rows]
        total = torch.logaddexp(lses, lsep)
        o[rows] = os_ * torch.exp(lses - total) + op * torch.exp(lsep - total)
        return o.to(q.dtype)
