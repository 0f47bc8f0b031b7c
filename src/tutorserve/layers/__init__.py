"""Model building blocks that know nothing of requests: paged attention and its backends,
fused norms and activations, rotary embeddings, the LoRA-wrapped linear layer."""
