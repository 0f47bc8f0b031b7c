"""Quantized weights served as they are: GGUF block formats kept in memory (`QuantWeight`, which
AWQ/GPTQ checkpoints' packed linears become), and the linear and embedding layers that compute
on them (`QuantLinear`, `QuantEmbedding`)."""

from tutorserve.quant.layers import QuantEmbedding, QuantLinear, Scratch, quantized_blocks
from tutorserve.quant.weight import QuantWeight

__all__ = ["QuantEmbedding", "QuantLinear", "QuantWeight", "Scratch", "quantized_blocks"]
