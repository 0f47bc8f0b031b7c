"""Greedy outputs token-identical to Hugging Face transformers on the same weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tutorserve import LLM, SamplingParams
from tutorserve.models.registry import resolve

N_NEW = 24


@pytest.mark.parametrize("fixture", ["synth_llama", "synth_qwen2", "synth_qwen3"])
def test_synthetic_parity_batched_with_shared_prefixes(
    fixture, mixed_prompts, request, hf_greedy, cpu_isa
):
    """With each ISA level of the CPU kernels forced (attention, norm and activation)."""
    path = request.getfixturevalue(fixture)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_greedy(hf, mixed_prompts, N_NEW)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=256)
    outs = llm.generate(
        mixed_prompts, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == ref
    # The shared prefix really was served from the cache for the later requests.
    assert sum(o.metrics.num_cached_tokens for o in outs) >= 64 * 6


@pytest.fixture(scope="module")
def smollm2():
    path = resolve("smollm2-135m-instruct")
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    # Dequantized as transformers loads it: the blocks' int8 activations would move the logits.
    llm = LLM(
        "smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_bytes=256 << 20
    )
    return hf, tok, llm


@pytest.mark.slow
def test_smollm2_gguf_parity(smollm2, hf_greedy):
    hf, tok, llm = smollm2
    course = (  # long enough to span several KV blocks, so the prefix cache serves it
        "You are a patient tutor for a class of secondary-school students. Ask one guiding "
        "question at a time, never reveal the final answer, and praise effort rather than "
        "talent. When a student is stuck, give a small hint that points at the next step. "
        "Use short sentences and plain words. Check understanding by asking the student to "
        "explain the idea back in their own words before moving on to a new problem. "
    )
    questions = [
        "How do I solve x^2 - 5x + 6 = 0?",
        "What is a variable?",
        "Why does factoring work?",
        "Explain the past tense of 'go'.",
        "What is photosynthesis?",
        "Is 17 a prime number?",
        "What is 3/4 + 1/8?",
        "Define a noun.",
    ]
    prompts = []
    for q in questions:
        prompts.append(
            tok.encode(
                llm.render_chat(
                    [{"role": "system", "content": course}, {"role": "user", "content": q}]
                ),
                add_special_tokens=False,
            )
        )
        prompts.append(tok.encode(f"Question: {q}\nAnswer:", add_special_tokens=False))
    ref = hf_greedy(hf, prompts, 12)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref
    hits = [o.metrics.num_cached_tokens for o in outs]
    assert sum(hits) >= 7 * 64, hits


@pytest.mark.slow
def test_smollm2_tokenizer_and_template_match_transformers(smollm2):
    _, tok, llm = smollm2
    texts = [
        "Hello world! 12345 apples",
        "  Solve x^2-5x+6=0.\n\nThen   explain…",
        "<|im_start|>user\nWhat's 2+2?<|im_end|>",
        "Ça va? naïve café 東京 ✓",
    ]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert llm.tokenizer.encode(text) == ids
        assert llm.tokenizer.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert llm.render_chat(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.slow
def test_smollm2_answers_sensibly(smollm2):
    _, _, llm = smollm2
    out = llm.chat(
        [{"role": "user", "content": "Explain photosynthesis in one sentence."}],
        SamplingParams(temperature=0, max_tokens=48),
    )[0]
    assert out.finish_reason == "stop"
    assert "photosynthesis" in out.text.lower() and "light" in out.text.lower()
