"""One quantized weight matrix: rows of GGUF blocks, as llama.cpp lays them out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from tutorserve.kernels import quant


@dataclass(frozen=True, slots=True)
class QuantWeight:
    blocks: torch.Tensor  # [out features, bytes per row] uint8
    fmt: str  # a key of kernels.quant.FORMATS
    in_features: int

    def __post_init__(self) -> None:
        if self.fmt not in quant.FORMATS:
            raise ValueError(
                f"unsupported quantization {self.fmt}; ours: {', '.join(quant.FORMATS)}"
            )
        _, group, nbytes = quant.FORMATS[self.fmt]
        if self.in_features % group or self.blocks.shape[1] != self.in_features // group * nbytes:
            raise ValueError(
                f"{self.fmt} rows of {self.in_features} weights need whole blocks of {group}"
            )

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @classmethod
    def quantize(cls, w: torch.Tensor, fmt: str) -> QuantWeight:
        """`w` [out, in] in `fmt` (the formats gguf can write: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1)."""
        arr = w.detach().float().cpu().numpy()
        blocks = quants.quantize(np.ascontiguousarray(arr), GGMLQuantizationType[fmt])
        return cls(torch.from_numpy(blocks), fmt, w.shape[1])

    def repacked(self) -> QuantWeight:
        """This weight in its format's repacked layout (`kernels.quant.repack16`) where it has
        one and the rows come in sixteens, else itself."""
        fmt = quant.REPACKED.get(self.fmt)
        if fmt is None or self.out_features % 16:
            return self
        blocks = quant.repack16(self.blocks, self.fmt, self.in_features)
        return QuantWeight(blocks, fmt, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return quant.dequantize(self.blocks, self.fmt, self.in_features, dtype)
