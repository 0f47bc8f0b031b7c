"""Decoder models that describe their own architecture, the registry from `model_type` to
class, and loading weights and tokenizers from HF folders or GGUF files."""
