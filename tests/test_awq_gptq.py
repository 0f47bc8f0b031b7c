"""AWQ and GPTQ checkpoints: a synthetic model quantized by hand into each method's layout
(packed here one nibble at a time, as the formats are documented), loaded into our int4 blocks
(checked with gguf's own Q4_1 dequantizer) or into floats (checked bit for bit, and against
transformers on the same dequantized weights)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM

from tutorserve import LLM
from tutorserve.bench.teacher_forced import forward_logits, perplexity
from tutorserve.kernels import quant
from tutorserve.quant import QuantLinear
from tutorserve.quant.awq_gptq import packed_linears, scheme_of

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM layout: nibble n holds column 8c + this


def pack_words(values: np.ndarray, order: list[int] | None = None) -> np.ndarray:
    """[..., 8m] 4-bit values → [..., m] int32, value 8c + order[n] in nibble n of word c."""
    order = order or list(range(8))
    v = values.astype(np.uint32).reshape(*values.shape[:-1], -1, 8)
    words = np.zeros(v.shape[:-1], np.uint32)
    for n in range(8):
        words |= v[..., order[n]] << np.uint32(4 * n)
    return words.view(np.int32)


def quantize_by_hand(w: np.ndarray, group: np.ndarray, groups: int, symmetric: bool):
    """Min/max 4-bit quantization of w [out, in] by input group: codes, fp16 scales and
    zeros [groups, out], and the dequantized weight scale · (code − zero)."""
    out = w.shape[0]
    scales = np.zeros((groups, out), np.float16)
    zeros = np.zeros((groups, out), np.int64)
    for g in range(groups):
        cols = w[:, group == g]
        if symmetric:
            s, z = np.abs(cols).max(1) / 7, np.full(out, 8)
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            s = (hi - lo) / 15
            z = np.clip(np.rint(-lo / s.astype(np.float16).astype(np.float64)), 0, 15)
        scales[g], zeros[g] = s.astype(np.float16), z
    s = scales[group].T.astype(np.float64)
    z = zeros[group].T
    codes = np.clip(np.rint(w / s) + z, 0, 15).astype(np.int64)
    return codes, scales, zeros, ((codes - z) * s).astype(np.float32)


def pack_linear(w: torch.Tensor, method: str, group_size: int, *, v1=False, act_order=False):
    """One linear in `method`'s tensors, and its weight as the method dequantizes it."""
    out, k = w.shape
    size = k if group_size == -1 else group_size
    group = np.arange(k) // size
    if act_order:  # GPTQ's desc_act: groups follow a permutation of the inputs
        group = group[np.random.default_rng(k + out).permutation(k)]
    groups = int(group.max()) + 1
    codes, scales, zeros, ref = quantize_by_hand(w.double().numpy(), group, groups, v1)
    if method == "awq":
        parts = {
            "qweight": pack_words(codes.T, AWQ_ORDER),
            "qzeros": pack_words(zeros, AWQ_ORDER),
        }
    else:  # GPTQ packs the codes down the inputs; v1 stores each zero less one
        parts = {
            "qweight": pack_words(codes.T.reshape(k // 8, 8, out).transpose(0, 2, 1))[..., 0],
            "qzeros": pack_words(zeros - int(v1)),
            "g_idx": group.astype(np.int32),
        }
    parts["scales"] = scales
    return {n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in parts.items()}, ref


def write_checkpoint(src: Path, dst: Path, method: str, group_size: int, **kw) -> dict:
    """`src` with its projections packed by `method` into `dst`; returns the dequantized
    weights by tensor name."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors, refs = {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if name.rsplit(".", 2)[-2] in PROJECTIONS:
            parts, refs[name] = pack_linear(t.float(), method, group_size, **kw)
            prefix = name.removesuffix(".weight")
            tensors |= {f"{prefix}.{p}": v for p, v in parts.items()}
        else:
            tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        qc |= {"version": "gemm", "zero_point": True}
    else:
        qc |= {"desc_act": kw.get("act_order", False), "sym": kw.get("v1", False)}
        qc["checkpoint_format"] = "gptq" if kw.get("v1") else "gptq_v2"
    (dst / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))
    return refs


CASES = {
    "awq-g32": ("awq", 32, {}),
    "awq-g64": ("awq", 64, {}),
    "gptq-v1-sym-g32": ("gptq", 32, {"v1": True}),
    "gptq-v2-per-row": ("gptq", -1, {}),
    "gptq-groups-of-16": ("gptq", 16, {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def packed(request, synth_llama, tmp_path_factory):
    method, group_size, kw = CASES[request.param]
    dst = tmp_path_factory.mktemp("packed") / request.param
    return dst, write_checkpoint(Path(synth_llama), dst, method, group_size, **kw), group_size


def test_each_linear_unpacks_to_the_methods_weights_and_into_q4_1_blocks(packed):
    """Floats: bit for bit. Q4_1 blocks, read by gguf's own dequantizer: equal up to the fp16
    rounding of each block's minimum (−scale · zero), where every 32 inputs share a group."""
    folder, refs, group_size = packed
    scheme = scheme_of(json.loads((folder / "config.json").read_text()), folder)
    tensors = load_file(str(folder / "model.safetensors")).items()
    for keep in (False, True):
        got = dict(packed_linears(iter(tensors), scheme, keep=keep))
        for name, ref in refs.items():
            w = got[name]
            fits = ref.shape[1] % 32 == 0 and (group_size % 32 == 0 or group_size == -1)
            if not (keep and fits):
                assert torch.equal(w, torch.from_numpy(ref)), name
                continue
            assert w.fmt == "Q4_1", name
            blocks = quants.dequantize(w.blocks.numpy(), GGMLQuantizationType.Q4_1)
            bound = 15 * 2.0**-11 * np.abs(ref).max() + 1e-6  # |m| ≤ 15 scales ≤ ~|w| max
            assert np.abs(blocks - ref).max() <= bound, name


def test_a_packed_checkpoint_serves_on_int4_blocks_and_dequantized_matches_transformers(
    packed, tmp_path
):
    """none: the dequantized model's logits equal transformers' on the same float weights;
    auto: its projections run on Q4_1 blocks (where groups fit) within 1 % perplexity."""
    folder, refs, group_size = packed
    plain = tmp_path / "dequantized"
    shutil.copytree(folder, plain)
    tensors = load_file(str(folder / "model.safetensors"))
    for name, ref in refs.items():
        prefix = name.removesuffix(".weight")
        for part in ("qweight", "qzeros", "scales", "g_idx"):
            tensors.pop(f"{prefix}.{part}", None)
        tensors[name] = torch.from_numpy(ref)
    save_file(tensors, str(plain / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    del config["quantization_config"]
    (plain / "config.json").write_text(json.dumps(config))

    ids = list(range(5, 60))
    none = LLM(str(folder), dtype="float32", quantization="none").engine.model
    hf = AutoModelForCausalLM.from_pretrained(plain, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(forward_logits(none, ids), want, atol=1e-4, rtol=1e-4)

    auto = LLM(str(folder), dtype="float32", quantization="auto").engine.model
    fits = group_size % 32 == 0 or group_size == -1
    for layer in auto.layers:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj]
        want_fmt = quant.REPACKED["Q4_1"]
        for m in linears:
            assert isinstance(m, QuantLinear if fits else nn.Linear)
            assert not fits or m.fmts == [want_fmt] * len(m.fmts)
        # its 176 inputs are not whole blocks of 32, whatever the groups
        assert isinstance(layer.mlp.down_proj, nn.Linear)
    ppl = [perplexity(m, ids) for m in (none, auto)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.01, ppl


def test_act_order_groups_run_dequantized(synth_llama, tmp_path, caplog):
    refs = write_checkpoint(Path(synth_llama), tmp_path / "act", "gptq", 32, act_order=True)
    with caplog.at_level(logging.WARNING, logger="tutorserve.quant.awq_gptq"):
        model = LLM(str(tmp_path / "act"), dtype="float32", quantization="auto").engine.model
    assert "run dequantized" in caplog.text
    o_proj = model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, nn.Linear)
    assert torch.equal(
        o_proj.weight, torch.from_numpy(refs["model.layers.0.self_attn.o_proj.weight"])
    )


@pytest.mark.parametrize(
    ("edit", "quantization", "message"),
    [
        ({"bits": 8}, "auto", "only 4-bit"),
        ({"quant_method": "bitsandbytes"}, "auto", "ours: awq, gptq"),
        ({"version": "gemv"}, "auto", "ours: gemm"),
        ({}, "int4", "keeps its own quantization"),
        ("drop qzeros", "auto", "lacks qzeros"),
    ],
)
def test_bad_packed_checkpoints_get_a_clear_error(
    synth_llama, tmp_path, edit, quantization, message
):
    folder = tmp_path / "awq"
    write_checkpoint(Path(synth_llama), folder, "awq", 32)
    if edit == "drop qzeros":
        tensors = load_file(str(folder / "model.safetensors"))
        del tensors["model.layers.1.mlp.up_proj.qzeros"]
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] |= edit
        (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(folder), dtype="float32", quantization=quantization)
