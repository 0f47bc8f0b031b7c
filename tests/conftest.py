import random

import pytest
import torch

from tutorserve.models.synth import SynthSpec, synth_model


@pytest.fixture(scope="session")
def synth_llama(tmp_path_factory):
    return str(synth_model(tmp_path_factory.mktemp("llama"), SynthSpec(arch="llama")))


@pytest.fixture(scope="session")
def synth_qwen2(tmp_path_factory):
    spec = SynthSpec(arch="qwen2", tie_word_embeddings=True, heads=4, kv_heads=1, seed=1)
    return str(synth_model(tmp_path_factory.mktemp("qwen2"), spec))


@pytest.fixture(scope="session")
def mixed_prompts():
    """16 prompts of mixed lengths; half share a 70-token prefix (over 4 KV blocks)."""
    rng = random.Random(0)
    shared = [rng.randrange(3, 470) for _ in range(70)]
    prompts = []
    for i in range(16):
        body = [rng.randrange(3, 470) for _ in range(rng.randrange(1, 120))]
        prompts.append(shared + body if i % 2 else body)
    return prompts


@pytest.fixture(scope="session")
def hf_greedy():
    return _hf_greedy


def _hf_greedy(model, prompts, max_new_tokens):
    """Reference: transformers forward with its own KV cache, greedy, one unpadded prompt at a
    time, never stopping at EOS (`generate`'s min_new_tokens would mask EOS instead)."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            out = model(torch.tensor([p]), use_cache=True)
            tokens = [int(out.logits[0, -1].argmax())]
            for _ in range(max_new_tokens - 1):
                out = model(
                    torch.tensor([[tokens[-1]]]),
                    past_key_values=out.past_key_values,
                    use_cache=True,
                )
                tokens.append(int(out.logits[0, -1].argmax()))
            outs.append(tokens)
    return outs
