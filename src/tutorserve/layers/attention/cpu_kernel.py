"""Attention that reads the paged KV cache in place, in our C kernel (`kernels/`), on CPUs.

Decode rows, shared course prompts and prefill chunks all become sets of blocks with a key
count; the kernel attends over each set where its blocks lie (no gathered copies) and returns
float32 outputs with their log-sum-exp, so cascade attention merges them. Query heads of a KV
group fold into the query axis, so GQA reads each K/V block once per group. Where the kernel
takes its bf16 dot-product path, the backend keeps each block paired: K and V in the order that
path reads them (`kernels/kv_format.h`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tutorserve.kernels import isa, paged_attention
from tutorserve.layers.attention.backend import AttentionBackend, AttentionLayer
from tutorserve.layers.attention.metadata import (
    AttentionBatch,
    AttentionMetadata,
    DecodeBucket,
    SharedPrefixGroups,
    build_decode_batch,
)


@dataclass(slots=True)
class KernelPrefill:
    start: int
    end: int
    table: torch.Tensor  # [blocks] int64, through this chunk
    kv_len: torch.Tensor  # [1] int64 keys after this chunk (the kernel takes int64 pointers)
    q_start: torch.Tensor  # [1] int64 position of the chunk's first token


class CPUKernelBackend(AttentionBackend):
    name = "cpu-kernel"

    def __init__(self, paired_kv: bool = False) -> None:
        self.paired_kv = paired_kv

    @property
    def kv_layout(self) -> str:
        return "paired for bf16 dot products" if self.paired_kv else "rows"

    def __str__(self) -> str:
        kernels = isa.active()
        level = kernels.level if kernels else "no"
        return f"reads blocks in place ({level} kernels; {self.kv_layout})"

    def write(
        self, layer: AttentionLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> None:
        if not paged_attention.supports_write(k, v, layer.k_cache):
            k, v = k.contiguous(), v.contiguous()  # views the kernel cannot stride through
        paged_attention.write_kv(k, v, slots, layer.k_cache, layer.v_cache, self.paired_kv)

    def build(self, batch: AttentionBatch) -> AttentionMetadata[KernelPrefill]:
        dev = batch.device
        prefills = [
            KernelPrefill(
                p.start,
                p.end,
                torch.as_tensor(p.table, device=dev),
                torch.tensor([p.context_len]),
                torch.tensor([p.first_pos]),
            )
            for p in batch.prefills
        ]
        decode = build_decode_batch(batch, in_place=True) if batch.decode_lens else None
        return AttentionMetadata(decode, prefills)

    def decode_rows(
        self, layer: AttentionLayer, q: torch.Tensor, bucket: DecodeBucket, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rows, kvh, dim = q.shape[0], layer.num_kv_heads, layer.head_dim
        o, lse = paged_attention.paged_attention(
            q.view(rows, kvh, layer.group, dim), layer.k_cache, layer.v_cache, bucket.tables,
            bucket.lens, layer.scale, paired_kv=self.paired_kv,
        )  # fmt: skip
        return o.view(rows, layer.num_heads, dim), lse.view(rows, layer.num_heads, 1)

    def shared_prefix(
        self, layer: AttentionLayer, qp: torch.Tensor, sp: SharedPrefixGroups, workspace: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ng, members, kvh, g, dim = qp.shape
        q = qp.transpose(1, 2).reshape(ng, kvh, members * g, dim)
        o, lse = paged_attention.paged_attention(
            q, layer.k_cache, layer.v_cache, sp.tables, sp.lens, layer.scale,
            paired_kv=self.paired_kv,
        )  # fmt: skip
        return (
            o.view(ng, kvh, members, g, dim).transpose(1, 2),
            lse.view(ng, kvh, members, g, 1).transpose(1, 2),
        )

    def prefill(
        self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        chunk: KernelPrefill, workspace: dict,
    ) -> torch.Tensor:  # fmt: skip
        n, kvh, g, dim = q.shape[0], layer.num_kv_heads, layer.group, layer.head_dim
        qs = q.view(n, kvh, g, dim).transpose(0, 1).reshape(1, kvh, n * g, dim)
        o, _ = paged_attention.paged_attention(
            qs, layer.k_cache, layer.v_cache, chunk.table[None], chunk.kv_len, layer.scale,
            chunk.q_start, g, self.paired_kv,
        )  # fmt: skip
        return o.view(kvh, n, g, dim).transpose(0, 1).reshape(n, layer.num_heads, dim).to(q.dtype)
