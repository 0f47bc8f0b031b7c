"""Compiled CPU kernels for what PyTorch has no op for (attention over paged blocks in place)
or runs in many passes (residual add + RMSNorm, SiLU·up), one build per ISA level."""
