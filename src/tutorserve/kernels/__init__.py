"""Compiled kernels for what PyTorch has no op for."""
