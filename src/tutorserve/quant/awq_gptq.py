"""AWQ and GPTQ checkpoints: 4-bit codes packed eight to an int32 word, with a scale and a zero
per group of inputs (w = scale · (code − zero)). Where each run of 32 inputs shares one group,
a linear becomes Q4_1 blocks (w = d · code + m) with d = scale and m = −scale · zero, so it
runs on our int4 kernels; elsewhere (act-order groups, groups under 32 inputs) it is
dequantized to floats."""

from __future__ import annotations

import json
import logging
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from tutorserve.kernels import quant
from tutorserve.quant.weight import QuantWeight

log = logging.getLogger(__name__)

PARTS = ("qweight", "qzeros", "scales", "g_idx")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
# AWQ's GEMM packing puts output columns 0, 2, 4, 6, 1, 3, 5, 7 in a word's nibbles 0..7; so
# column j sits in nibble _AWQ_NIBBLE[j].
_AWQ_NIBBLE = [0, 4, 1, 5, 2, 6, 3, 7]
_BLOCK = quant.FORMATS["Q4_1"][1]


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """One linear unpacked: codes [out, in] in 0..15, scales and zeros [out, groups], and the
    group of each input [in]."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        g = self.group
        return (self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g].float()

    def fits_blocks(self) -> bool:
        """Whether every Q4_1 block (32 inputs in a row) falls in one group."""
        if self.group.numel() % _BLOCK:
            return False
        runs = self.group.view(-1, _BLOCK)
        return bool((runs == runs[:, :1]).all())

    def q4_1(self) -> QuantWeight:
        """As Q4_1 blocks; exact up to rounding m = −scale · zero to fp16 (at most 2⁻¹¹ of
        it, a few thousandths of the group's scale)."""
        out, k = self.codes.shape
        first = self.group.view(-1, _BLOCK)[:, 0]
        d = self.scales.float()[:, first]
        m = -(d * self.zeros.float()[:, first])  # exact in float32, one rounding to fp16 below
        halves = [v.half().contiguous().view(torch.uint8).view(out, -1, 2) for v in (d, m)]
        codes = self.codes.view(out, -1, _BLOCK)
        packed = codes[..., : _BLOCK // 2] | (codes[..., _BLOCK // 2 :] << 4)
        blocks = torch.cat([*halves, packed], dim=-1).reshape(out, -1)
        return QuantWeight(blocks.contiguous(), "Q4_1", k)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 words [..., n] → their eight 4-bit fields, lowest first, [..., n, 8] uint8."""
    return ((words.unsqueeze(-1) >> _SHIFTS) & 0xF).to(torch.uint8)


@dataclass(frozen=True, slots=True)
class PackedInt4(ABC):
    """How a method lays out a linear (both keep scales [groups, out] and zeros packed along
    the outputs [groups, out / 8])."""

    method: ClassVar[str]
    group_size: int  # inputs per group; -1: one group per output row

    @abstractmethod
    def _qweight_columns(self, out: int) -> int: ...

    @abstractmethod
    def _codes_and_zeros(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, groups: int, out: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """codes [out, in] (0..15) and the zeros of w = scale · (code − zero), [groups, out]."""

    def unpack(self, parts: dict[str, torch.Tensor]) -> Int4Groups:
        qweight, scales = parts["qweight"], parts["scales"]
        groups, out = scales.shape
        if qweight.shape[1] != self._qweight_columns(out):
            raise ValueError(
                f"{self.method} qweight {tuple(qweight.shape)} does not match its scales "
                f"{tuple(scales.shape)}"
            )
        codes, zeros = self._codes_and_zeros(qweight, parts["qzeros"], groups, out)
        k = codes.shape[1]
        if "g_idx" in parts:
            group = parts["g_idx"].long()
        else:
            group = torch.arange(k) // (k if self.group_size == -1 else self.group_size)
        if group.shape != (k,) or int(group.max()) >= groups:
            raise ValueError(f"{self.method} groups do not match {k} inputs and {groups} scales")
        return Int4Groups(codes.contiguous(), scales.T.contiguous(), zeros.T.contiguous(), group)


@dataclass(frozen=True, slots=True)
class AWQPacking(PackedInt4):
    """AutoAWQ's GEMM packing: qweight [in, out / 8], words run along the outputs."""

    method: ClassVar[str] = "awq"

    def _qweight_columns(self, out: int) -> int:
        return out // 8

    def _codes_and_zeros(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, groups: int, out: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        codes = _nibbles(qweight)[..., _AWQ_NIBBLE].reshape(qweight.shape[0], out).T
        return codes, _nibbles(qzeros)[..., _AWQ_NIBBLE].reshape(groups, out)


@dataclass(frozen=True, slots=True)
class GPTQPacking(PackedInt4):
    """GPTQ: qweight [in / 8, out], words run along the inputs; the original format (v1)
    stores each zero less one."""

    method: ClassVar[str] = "gptq"
    zero_offset: int = 0

    def _qweight_columns(self, out: int) -> int:
        return out

    def _codes_and_zeros(
        self, qweight: torch.Tensor, qzeros: torch.Tensor, groups: int, out: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        codes = _nibbles(qweight).permute(0, 2, 1).reshape(-1, out).T
        zeros = _nibbles(qzeros).reshape(groups, out).to(torch.int16) + self.zero_offset
        return codes, zeros


def scheme_of(raw_config: dict, folder: Path) -> PackedInt4 | None:
    """The checkpoint's AWQ/GPTQ packing from its config.json (or AutoGPTQ's
    quantize_config.json); None for a float checkpoint."""
    qc = raw_config.get("quantization_config")
    legacy = folder / "quantize_config.json"
    if qc is None and legacy.exists():
        qc = {"quant_method": "gptq", **json.loads(legacy.read_text())}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        raise ValueError(f"{method or 'unnamed'} checkpoints are not supported; ours: awq, gptq")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{method} checkpoints with {bits} bits are not supported: only 4-bit")
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm" or not qc.get("zero_point", True):
            raise ValueError(f"AWQ {version} packing is not supported; ours: gemm with zeros")
        return AWQPacking(group_size)
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint format {fmt} is not supported; ours: gptq, gptq_v2")
    return GPTQPacking(group_size, 1 if fmt == "gptq" else 0)


def packed_linears(
    tensors: Iterator[tuple[str, torch.Tensor]], scheme: PackedInt4, keep: bool
) -> Iterator[tuple[str, torch.Tensor | QuantWeight]]:
    """A checkpoint's tensors with each packed linear (`<name>.qweight`, `.qzeros`, `.scales`,
    GPTQ's optional `.g_idx`) turned into `<name>.weight`: Q4_1 blocks if `keep` and its groups
    fit them, else floats. A linear's parts may come in any order, from any file, so they are
    gathered first (packed, they are an eighth of the float weights)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors:
        prefix, _, part = name.rpartition(".")
        if part in PARTS:
            pending.setdefault(prefix, {})[part] = t
        else:
            yield name, t
    as_floats = []
    for prefix, parts in pending.items():
        missing = [p for p in PARTS[:3] if p not in parts]
        if missing:
            raise ValueError(f"{scheme.method} linear {prefix} lacks {', '.join(missing)}")
        linear = scheme.unpack(parts)
        if keep and linear.fits_blocks():
            yield f"{prefix}.weight", linear.q4_1()
        else:
            as_floats.append(prefix)
            yield f"{prefix}.weight", linear.dequantize()
    if keep and as_floats:
        log.warning(
            "%d %s linears run dequantized (rows not in runs of %d inputs of one group), e.g. %s",
            len(as_floats),
            scheme.method,
            _BLOCK,
            as_floats[0],
        )
