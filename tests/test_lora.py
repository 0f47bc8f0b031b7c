"""Multi-LoRA: each adapter's greedy tokens equal transformers + peft with that adapter; a mixed
batch equals its requests run one by one; more adapters than slots are paged; bad adapters get
clear errors."""

import copy
import json
import random

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from tutorserve import LLM, SamplingParams
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config
from tutorserve.paging import hash_block
from tutorserve.quant import QuantWeight

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
# (rank, targets): mixed ranks, attention-only, MLP-only and everything.
SPECS = [
    (4, ("q_proj", "v_proj")),
    (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (16, ("gate_proj", "up_proj", "down_proj")),
    (16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    (8, ("o_proj", "down_proj")),
    (4, ("k_proj", "up_proj")),
    (12, ("v_proj", "gate_proj")),
    (16, ("q_proj", "down_proj")),
]


@pytest.fixture(scope="module")
def adapters(synth_llama, tmp_path_factory):
    cfg = load_model_config(synth_llama)
    root = tmp_path_factory.mktemp("loras")
    return {
        f"lora{i}": str(synth_lora(root / f"lora{i}", cfg, rank, targets, seed=i, strength=1.5))
        for i, (rank, targets) in enumerate(SPECS)
    }


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(3)
    shared = [rng.randrange(3, 470) for _ in range(40)]
    return [shared + [rng.randrange(3, 470) for _ in range(rng.randrange(1, 30))] for _ in range(9)]


@pytest.fixture(scope="module")
def peft_reference(synth_llama, adapters, prompts, hf_greedy):
    """prompt i under adapter i (the last prompt under the base model), by transformers+peft."""
    out = []
    for i, p in enumerate(prompts):
        model = AutoModelForCausalLM.from_pretrained(synth_llama, dtype=torch.float32)
        if i < len(adapters):
            model = PeftModel.from_pretrained(model, adapters[f"lora{i}"])
        out.append(hf_greedy(model.eval(), [p], GREEDY.max_tokens)[0])
    return out


def lora_llm(model, adapters, **kw):
    return LLM(model, dtype="float32", lora_modules=adapters, max_lora_rank=16, **kw)


def test_each_adapter_matches_peft_and_changes_the_output(
    synth_llama, adapters, prompts, peft_reference
):
    llm = lora_llm(synth_llama, adapters)
    base = llm.generate(prompts[:8], GREEDY)
    for i in range(8):
        out = llm.generate([prompts[i]], GREEDY, lora=f"lora{i}")[0]
        assert out.token_ids == peft_reference[i], f"lora{i}"
        assert out.token_ids != base[i].token_ids, f"lora{i} changed nothing"


def test_mixed_batch_equals_one_by_one(synth_llama, adapters, prompts, peft_reference):
    llm = lora_llm(synth_llama, adapters)
    names = [f"lora{i}" for i in range(8)] + [None]
    outs = llm.generate(prompts, GREEDY, lora=names)
    assert [o.token_ids for o in outs] == peft_reference
    llm.engine.kv.pool.check_integrity()


def test_more_adapters_than_slots_are_paged(synth_llama, adapters, prompts, peft_reference):
    llm = lora_llm(synth_llama, adapters, max_loras=2, max_cpu_loras=3)
    manager = llm.engine.lora
    peak = 0
    step = llm.engine.step

    def counting_step():
        nonlocal peak
        running = {s.lora for s in llm.engine.scheduler.running if s.lora}
        peak = max(peak, len(running))
        assert sum(1 for s in manager.slots if s) <= 2
        return step()

    llm.engine.step = counting_step
    names = [f"lora{i}" for i in range(8)] + [None]
    outs = llm.generate(prompts * 2, GREEDY, lora=names * 2)
    assert [o.token_ids for o in outs] == peft_reference * 2
    assert peak == 2  # the cap was reached and never exceeded
    assert manager.num_slot_loads >= 8 and manager.num_disk_loads > 0  # paged in from disk
    assert len(manager.ram) <= 3 and sum(manager.refs) == 0


def test_waiting_adapter_is_not_starved(synth_llama, adapters):
    """One slot, a stream of lora0 requests, and one lora1 request in the middle: the lora1
    request is admitted after at most max_bypass others, not after the whole stream."""
    llm = lora_llm(synth_llama, adapters, max_loras=1, max_bypass=3, max_num_seqs=2)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("first", [5, 6, 7], params, lora="lora0")
    engine.add_request("other", [5, 6, 8], params, lora="lora1")
    for k in range(20):
        engine.add_request(f"more{k}", [5, 6, 9, k + 10], params, lora="lora0")
    finished = []
    while engine.has_unfinished():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished.index("other") <= 1 + 3 + 2  # first, ≤ 3 bypasses, ≤ 2 running then


def test_prefix_cache_is_not_shared_across_adapters(synth_llama, adapters, prompts):
    llm = lora_llm(synth_llama, adapters)
    prompt = prompts[0][:40] + [7] * 30  # several full blocks
    first = llm.generate([prompt], GREEDY, lora="lora0")[0]
    again = llm.generate([prompt], GREEDY, lora="lora0")[0]
    other = llm.generate([prompt], GREEDY, lora="lora1")[0]
    base = llm.generate([prompt], GREEDY)[0]
    assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == 64
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0
    assert llm.engine.kv.pool.lookup(hash_block(b"", prompt[:16])) is not None  # the base's


def test_bad_adapters_are_refused_clearly(synth_llama, adapters, tmp_path):
    llm = lora_llm(synth_llama, {"lora0": adapters["lora0"]})
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        llm.generate([[5, 6]], GREEDY, lora="nope")
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora("lora0", adapters["lora1"])
    with pytest.raises(ValueError, match="not found"):
        llm.load_lora("missing", str(tmp_path / "nothing-here"))
    cfg = load_model_config(synth_llama)
    # rank above the limit
    big = synth_lora(tmp_path / "big", cfg, 32, seed=9)
    with pytest.raises(ValueError, match=r"rank 32 outside 1\.\.16"):
        llm.load_lora("big", str(big))
    # shapes of another base model
    other = synth_lora(tmp_path / "other", cfg, 4, seed=9)
    weights = load_file(other / "adapter_model.safetensors")
    key = next(k for k in weights if k.endswith("q_proj.lora_A.weight"))
    weights[key] = torch.zeros(4, cfg.hidden_size * 2)
    save_file(weights, other / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="the base needs A"):
        llm.load_lora("other", str(other))
    # a target we do not serve
    emb = synth_lora(tmp_path / "emb", cfg, 4, seed=9)
    weights = load_file(emb / "adapter_model.safetensors")
    weights["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(4, 8)
    save_file(weights, emb / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="unsupported weight"):
        llm.load_lora("emb", str(emb))
    dora = synth_lora(tmp_path / "dora", cfg, 4, seed=9)
    conf = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        llm.load_lora("dora", str(dora))
    assert llm.engine.lora_names() == ["lora0"]
    plain = LLM(synth_llama, dtype="float32")
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.generate([[5, 6]], GREEDY, lora="lora0")


def test_adapter_gone_from_disk_fails_only_its_request(synth_llama, adapters, tmp_path):
    cfg = load_model_config(synth_llama)
    doomed = synth_lora(tmp_path / "doomed", cfg, 4, seed=5)
    llm = lora_llm(synth_llama, {"doomed": str(doomed), "lora1": adapters["lora1"]},
                   max_loras=1, max_cpu_loras=1)  # fmt: skip
    assert list(llm.engine.lora.ram) == ["lora1"]  # "doomed" is paged out to disk
    (doomed / "adapter_model.safetensors").unlink()
    bad, good = llm.generate([[5, 6, 7], [5, 6, 8]], GREEDY, lora=["doomed", "lora1"])
    assert bad.finish_reason == "abort" and not bad.token_ids
    assert good.finish_reason == "length" and len(good.token_ids) == GREEDY.max_tokens
    llm.engine.kv.pool.check_integrity()


def test_qwen2_with_biases_matches_peft(synth_qwen2, tmp_path, hf_greedy):
    cfg = load_model_config(synth_qwen2)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    path = str(synth_lora(tmp_path / "qwen", cfg, 8, targets, seed=4, strength=1.5))
    prompt = [[11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 3]
    model = AutoModelForCausalLM.from_pretrained(synth_qwen2, dtype=torch.float32)
    want = hf_greedy(PeftModel.from_pretrained(model, path).eval(), prompt, GREEDY.max_tokens)
    llm = lora_llm(synth_qwen2, {"qwen": path})
    assert llm.generate(prompt, GREEDY, lora="qwen")[0].token_ids == want[0]


def test_adapters_on_an_int8_base_match_peft_on_its_dequantized_weights(
    synth_llama, adapters, prompts, hf_greedy
):
    """The low-rank part stays float over a quantized base: the reference is peft over the
    base's linears as the int8 path holds them (whole blocks of 32 quantized, the rest float)."""
    base = AutoModelForCausalLM.from_pretrained(synth_llama, dtype=torch.float32)
    for name, mod in base.named_modules():
        if isinstance(mod, nn.Linear) and name.endswith("_proj") and mod.in_features % 32 == 0:
            mod.weight.data = QuantWeight.quantize(mod.weight.data, "Q8_0").dequantize()
    llm = lora_llm(synth_llama, adapters, quantization="int8")
    for i in (1, 3):
        ref = PeftModel.from_pretrained(copy.deepcopy(base), adapters[f"lora{i}"]).eval()
        want = hf_greedy(ref, [prompts[i]], GREEDY.max_tokens)[0]
        assert llm.generate([prompts[i]], GREEDY, lora=f"lora{i}")[0].token_ids == want
