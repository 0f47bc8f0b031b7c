"""Quantized weights: the block kernels against gguf's own dequantizer and a float64 matmul at
every ISA level the CPU runs; the quantized layers against PyTorch on the dequantized weight; and
the default model served on its Q4_1 blocks against the same model dequantized."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from tutorserve import LLM, SamplingParams
from tutorserve.bench.roofline import Machine, decode_bound, weight_bytes
from tutorserve.bench.teacher_forced import forward_logits, perplexity
from tutorserve.kernels import quant
from tutorserve.quant import QuantEmbedding, QuantLinear, QuantWeight, Scratch
from tutorserve.quant.layers import (
    GEMM_ROWS,
    GEMV_ROWS,
    GEMV_ROWS_DEFAULT,
    dequantizing_rows,
    keep_on_blocks,
)

REPACKED = list(quant.REPACKED.values())
FORMATS = [fmt for fmt in quant.FORMATS if fmt not in REPACKED]  # GGUF's own
WRITABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]  # the formats gguf can quantize to


def random_blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Blocks of random bits with small finite fp16 scales: every code a block can hold."""
    _, group, nbytes = quant.FORMATS[fmt]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // group, nbytes), dtype=np.uint8)

    def put(offset: int, low: float, high: float) -> None:
        half = rng.uniform(low, high, (n, k // group)).astype(np.float16)
        raw[:, :, offset : offset + 2] = half.view(np.uint8).reshape(n, k // group, 2)

    if fmt in ("Q4_K", "Q5_K"):
        put(0, 1e-3, 1e-2)
        put(2, 1e-3, 1e-2)
    elif fmt == "Q6_K":
        put(208, 1e-3, 1e-2)
    else:
        put(0, -1e-2, 1e-2)
        if fmt in ("Q4_1", "Q5_1"):
            put(2, -5e-2, 5e-2)
    return raw.reshape(n, -1)


def reference(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[fmt]).astype(np.float64)


def as_kernel_reads(x: torch.Tensor) -> np.ndarray:
    """x [B, k] as the kernels multiply it (on integers, kernels/quant_x8.c), in float64: each
    group of four values rounded to int8 codes (scale max|x| / 127, to nearest even)."""
    v = x.float().numpy()
    blocks = v.reshape(v.shape[0], -1, 4)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax > 0)
    codes = np.rint(blocks * inv)
    assert np.abs(codes).max() <= 127
    return (codes.astype(np.float64) * (amax / np.float32(127))).reshape(v.shape)


def assert_rows_as_alone(w: torch.Tensor, fmt: str, k: int, x: torch.Tensor, y: torch.Tensor):
    """Each row of a matmul is bit for bit what it gives alone: the tile a row shares with
    others must not change its sums (speculative drafts verified beside a row must give it
    plain decoding's logits)."""
    for r in range(x.shape[0]):
        assert torch.equal(quant.matmul(w, fmt, k, x[r : r + 1])[0], y[r]), f"row {r}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_kernels_match_gguf_dequantize_and_a_float64_matmul(cpu_isa, fmt):
    k = 512 if quant.FORMATS[fmt][1] == 256 else 96  # whole blocks, an odd count of them
    blocks = random_blocks(fmt, 67, k)
    ref = reference(blocks, fmt)
    w = torch.from_numpy(blocks)
    assert np.array_equal(quant.dequantize(w, fmt, k).numpy(), ref.astype(np.float32))
    rows = torch.tensor([66, 0, 5, 5])
    assert torch.equal(quant.dequantize(w, fmt, k, rows=rows), torch.from_numpy(ref[rows]).float())
    bf16 = quant.dequantize(w, fmt, k, torch.bfloat16)
    assert torch.equal(bf16, torch.from_numpy(ref).float().bfloat16())
    for batch in (1, 3, 4, 5, 17):  # below, at and above the tiles (4 rows; 6 or 8 with AVX-512)
        for x in (torch.randn(batch, k), torch.randn(batch, k).bfloat16()):
            y = quant.matmul(w, fmt, k, x)
            want = as_kernel_reads(x) @ ref.T  # exact products, float32 sums
            np.testing.assert_allclose(y.double().numpy(), want, atol=2e-6 * np.abs(want).max())
            assert_rows_as_alone(w, fmt, k, x, y)
            out = quant.matmul(w, fmt, k, x, torch.empty(batch, 67, dtype=torch.bfloat16))
            assert torch.equal(out, y.bfloat16())  # one rounding, to nearest even, as PyTorch's


@pytest.mark.parametrize("fmt", list(quant.REPACKED))
def test_repacked_rows_dequantize_and_multiply_as_their_gguf_rows(cpu_isa, fmt):
    k = 512 if quant.FORMATS[fmt][1] == 256 else 96
    blocks = random_blocks(fmt, 64, k)
    ref = reference(blocks, fmt)
    weight = QuantWeight(torch.from_numpy(blocks), fmt, k).repacked()
    w, repacked = weight.blocks, weight.fmt
    assert repacked == quant.REPACKED[fmt] and w.shape == blocks.shape
    assert not np.array_equal(w.numpy(), blocks)  # moved, not copied
    assert np.array_equal(quant.dequantize(w, repacked, k).numpy(), ref.astype(np.float32))
    rows = torch.tensor([63, 0, 17, 17])
    assert torch.equal(
        quant.dequantize(w, repacked, k, rows=rows), torch.from_numpy(ref[rows]).float()
    )
    # Below, at and above the tiles: 4 rows; 8 with AVX-512 for the 32-weight formats.
    for batch in (1, 3, 4, 5, 6, 7, 13):
        for x in (torch.randn(batch, k), torch.randn(batch, k).bfloat16()):
            y = quant.matmul(w, repacked, k, x)
            want = as_kernel_reads(x) @ ref.T
            np.testing.assert_allclose(y.double().numpy(), want, atol=2e-6 * np.abs(want).max())
            assert_rows_as_alone(w, repacked, k, x, y)
            out = quant.matmul(w, repacked, k, x, torch.empty(batch, 64, dtype=torch.bfloat16))
            assert torch.equal(out, y.bfloat16())
    # Rows not in sixteens, and formats without a repacked layout, stay as they are.
    odd = QuantWeight(torch.from_numpy(random_blocks(fmt, 40, k)), fmt, k)
    assert odd.repacked() is odd
    q5_1 = QuantWeight(torch.from_numpy(random_blocks("Q5_1", 64, 96)), "Q5_1", 96)
    assert q5_1.repacked() is q5_1
    with pytest.raises(ValueError, match="by sixteen"):
        quant.repack16(odd.blocks, fmt, k)


@pytest.mark.parametrize("fmt", [*quant.REPACKED.values(), "Q8_0"])
def test_the_bf16_gemm_multiplies_on_the_weight_dequantized_to_bf16(bf16_dot_isa, fmt):
    """The bf16 GEMM on repacked rows (and on Q8_0 in GGUF's layout, as an LM head keeps it)
    computes with exactly the weights `dequantize` writes in bf16 and the bf16 activations as
    they are: against a float64 matmul of both, float32 sums (the 32-weight formats at 3 blocks
    a row, the K-quants at 2: every position of a block); each row as it gives alone, whatever
    tile it shares; a bf16 output rounded once."""
    gguf = fmt.removesuffix("_R16")
    k = 512 if quant.FORMATS[gguf][1] == 256 else 96
    weight = QuantWeight(torch.from_numpy(random_blocks(gguf, 48, k)), gguf, k)
    if fmt != gguf:
        weight = weight.repacked()
    w, repacked = weight.blocks, weight.fmt
    assert repacked == fmt and quant.has_gemm(fmt, 48) and not quant.has_gemm(fmt, 40)
    dequantized = quant.dequantize(w, repacked, k, torch.bfloat16).double()
    gemm = quant.bind_gemm(w, repacked, k)
    for batch in (1, 7, 8, 9, 20):  # below, at and above the tile of eight rows
        x = torch.randn(batch, k).bfloat16()
        y = torch.empty(batch, 48)
        gemm(x, y)
        want = x.double() @ dequantized.T
        assert (y.double() - want).abs().max() <= 2e-6 * want.abs().max()
        for r in range(batch):
            alone = torch.empty(1, 48)
            gemm(x[r : r + 1], alone)
            assert torch.equal(alone[0], y[r]), f"row {r}"
        out = torch.zeros(batch, 60, dtype=torch.bfloat16)
        gemm(x, out[:, 4:52])  # a column slice of a wider output
        assert torch.equal(out[:, 4:52], y.bfloat16()) and not out[:, :4].any()


def test_the_bf16_gemm_is_only_where_the_cpu_has_the_bf16_dot_product(cpu_isa):
    w = QuantWeight(torch.from_numpy(random_blocks("Q4_0", 16, 64)), "Q4_0", 64).repacked()
    gemm = quant.bind_gemm(w.blocks, w.fmt, 64)
    if quant.has_gemm(w.fmt, 16):
        gemm(torch.randn(2, 64).bfloat16(), torch.empty(2, 16))
    else:
        with pytest.raises(ValueError, match="no bf16 dot product"):
            gemm(torch.randn(2, 64).bfloat16(), torch.empty(2, 16))


def test_matmul_writes_a_column_slice_and_refuses_partial_blocks(cpu_isa):
    blocks = torch.from_numpy(random_blocks("Q4_1", 8, 64))
    x = torch.randn(2, 64)
    out = torch.zeros(2, 20)
    quant.matmul(blocks, "Q4_1", 64, x, out[:, 6:14])
    want = torch.from_numpy(as_kernel_reads(x) @ reference(blocks.numpy(), "Q4_1").T)
    assert torch.allclose(out[:, 6:14].double(), want, atol=1e-5)
    assert out[:, :6].abs().sum() == 0 and out[:, 14:].abs().sum() == 0
    with pytest.raises(ValueError, match="not whole blocks"):
        quant.matmul(blocks, "Q4_1", 48, torch.randn(1, 48))
    with pytest.raises(ValueError, match="need whole blocks of 32"):
        QuantWeight(blocks, "Q4_1", 48)
    with pytest.raises(ValueError, match="unsupported quantization IQ2_XS"):
        QuantWeight(blocks, "IQ2_XS", 64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, GEMV_ROWS_DEFAULT + 1, 40, 257])
def test_a_fused_linear_of_mixed_formats_matches_pytorch_on_its_dequantized_weight(
    rows, dtype, bias
):
    """q and k in Q4_K, v in Q6_K, as a Q4_K_M file keeps them, then a Q4_1 part, each repacked;
    decode-sized batches multiply on the blocks (on int8 activations), larger ones in bf16 with
    the bf16 GEMM where the CPU has it, else on the dequantized weight."""
    spec = [("Q4_K", 48, 256), ("Q4_K", 16, 256), ("Q6_K", 16, 256), ("Q4_1", 16, 256)]
    parts = [
        QuantWeight(torch.from_numpy(random_blocks(f, n, k, seed=i)), f, k)
        for i, (f, n, k) in enumerate(spec)
    ]
    b = torch.randn(96) if bias else None
    layer = QuantLinear(parts, b, Scratch()).to(dtype)
    assert layer.fmts == ["Q4_K_R16", "Q6_K_R16", "Q4_1_R16"] and layer.gemv_rows == 256
    assert layer.gemm_rows == (GEMM_ROWS if quant.has_gemm("Q4_K_R16", 48) else sys.maxsize)
    x = torch.randn(rows, 256).to(dtype)
    exact = rows > layer.gemv_rows or (dtype == torch.bfloat16 and rows > layer.gemm_rows)
    read = (lambda x: x.double().numpy()) if exact else as_kernel_reads
    want = torch.cat(
        [torch.from_numpy(read(x) @ reference(p.blocks.numpy(), p.fmt).T) for p in parts],
        dim=1,
    )
    if b is not None:
        want += b.to(dtype).double()
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, 96)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.double() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("rows", [1, 40, GEMV_ROWS["Q4_1_R16"], GEMV_ROWS["Q4_1_R16"] + 1])
def test_a_repacked_layer_multiplies_on_its_blocks_up_to_its_own_row_count(rows):
    """Q4_1 rows in sixteens are repacked at load, and multiply on their blocks (int8
    activations) up to their own row count (256), where the GGUF layout stops at 12; above, on
    the dequantized weight."""
    w = QuantWeight(torch.from_numpy(random_blocks("Q4_1", 32, 256)), "Q4_1", 256)
    layer = QuantLinear([w], None, Scratch())
    assert layer.fmts == ["Q4_1_R16"] and layer.gemv_rows == GEMV_ROWS["Q4_1_R16"]
    x = torch.randn(rows, 256)
    read = as_kernel_reads if rows <= layer.gemv_rows else lambda x: x.double().numpy()
    want = read(x) @ reference(w.blocks.numpy(), "Q4_1").T
    got = layer(x).double().numpy()
    assert abs(got - want).max() <= 1e-5 * abs(want).max()


def test_a_q8_0_lm_head_takes_the_bf16_gemm_above_its_int8_rows_without_a_float_copy():
    """An LM head keeps GGUF's Q8_0 layout; above its 12 int8 rows, in bf16 on a CPU with the
    bf16 dot product, it multiplies on its blocks with the bf16 GEMM and never fills the
    scratch buffer (elsewhere it dequantizes into it, as before)."""
    w = QuantWeight(torch.from_numpy(random_blocks("Q8_0", 64, 64)), "Q8_0", 64)
    head = QuantLinear([w], None, Scratch(), repack=False)
    has = quant.has_gemm("Q8_0", 64)
    assert head.fmts == ["Q8_0"] and head.gemv_rows == GEMV_ROWS_DEFAULT
    assert head.gemm_rows == (GEMV_ROWS_DEFAULT if has else sys.maxsize)
    x = torch.randn(GEMV_ROWS_DEFAULT + 1, 64).bfloat16()
    want = x.double() @ quant.dequantize(w.blocks, "Q8_0", 64, torch.bfloat16).double().T
    got = head(x)
    assert got.dtype == torch.bfloat16
    assert (got.double() - want).abs().max() <= 1e-2 * want.abs().max()
    assert head.scratch.take(head, 0, 0, torch.bfloat16)[1] != has  # held only if dequantized


def test_kept_on_blocks_a_row_gives_what_it_gives_alone_at_any_row_count():
    """`--batch-invariant` keeps every row count on the int8 kernels, which sum a row alone:
    40 rows give each row's single-row result bit for bit, where the bf16 GEMM (and above 256
    rows, PyTorch's) would take them at that count."""
    w = QuantWeight(torch.from_numpy(random_blocks("Q4_1", 32, 256)), "Q4_1", 256)
    layer = QuantLinear([w], None, Scratch())
    keep_on_blocks(layer)
    x = torch.randn(300, 256).bfloat16()
    for rows in (40, 300):
        y = layer(x[:rows])
        assert all(torch.equal(layer(x[r : r + 1])[0], y[r]) for r in range(0, rows, 7))


def test_the_shared_buffer_is_dequantized_again_only_after_another_layer_took_it(monkeypatch):
    """Above its row limit a layer dequantizes into the buffer the layers share. Called again
    with no other layer in between (the LM head during large decode batches) it uses what the
    buffer holds; after another layer, or in another dtype, it dequantizes again."""
    scratch = Scratch()
    # Q5_1, which the bf16 GEMM does not take (a Q8_0 head takes it in bf16 where it runs)
    weights = [QuantWeight(torch.from_numpy(random_blocks("Q5_1", 64, 64, seed=s)), "Q5_1", 64)
               for s in (1, 2)]  # fmt: skip
    a, b = (QuantLinear([w], None, scratch, repack=False) for w in weights)  # as LM heads
    calls = []
    dequantize = quant.dequantize
    monkeypatch.setattr(
        quant, "dequantize", lambda *args, **kw: calls.append(1) or dequantize(*args, **kw)
    )
    x = torch.randn(20, 64)
    steps = [(a, torch.float32, 1), (a, torch.float32, 1), (b, torch.float32, 2),
             (a, torch.float32, 3), (a, torch.bfloat16, 4)]  # fmt: skip
    for layer, dtype, dequantized in steps:
        w = weights[0] if layer is a else weights[1]
        want = x.to(dtype).double() @ torch.from_numpy(reference(w.blocks.numpy(), "Q5_1")).T
        got = layer(x.to(dtype)).double()
        assert (got - want).abs().max() <= 3e-2 * want.abs().max()
        assert len(calls) == dequantized


def test_the_rows_a_model_dequantizes_above_are_those_of_most_of_its_weight(monkeypatch):
    """The step-cost model's dequantizing steps (bench/step_cost.py): a step of more tokens
    than `dequantizing_rows` dequantizes the bulk of the weight, one of as many does not."""
    big = QuantLinear([QuantWeight(torch.from_numpy(random_blocks("Q4_1", 64, 256)), "Q4_1",
                                   256)], None, Scratch())  # fmt: skip
    small = QuantLinear([QuantWeight(torch.from_numpy(random_blocks("Q5_1", 16, 64)), "Q5_1",
                                     64)], None, Scratch())  # fmt: skip
    assert dequantizing_rows(nn.Sequential(small), torch.float32) == GEMV_ROWS_DEFAULT
    assert dequantizing_rows(nn.Linear(4, 4), torch.float32) is None
    rows = dequantizing_rows(nn.ModuleList([small, big]), torch.float32)
    assert rows == GEMV_ROWS["Q4_1_R16"]
    calls = []
    dequantize = quant.dequantize
    monkeypatch.setattr(
        quant, "dequantize", lambda *args, **kw: calls.append(1) or dequantize(*args, **kw)
    )
    big(torch.randn(rows, 256))
    assert not calls
    big(torch.randn(rows + 1, 256))
    assert calls


def test_embedding_rows_and_a_tied_head_read_the_same_blocks():
    w = QuantWeight(torch.from_numpy(random_blocks("Q8_0", 50, 64)), "Q8_0", 64)
    emb = QuantEmbedding(w, torch.float32)
    ids = torch.tensor([[3, 49], [0, 3]])
    ref = torch.from_numpy(reference(w.blocks.numpy(), "Q8_0")).float()
    assert torch.equal(emb(ids), ref[ids])
    head = QuantLinear([emb.weight()], None, Scratch())
    assert head.blocks[0].data_ptr() == emb.blocks.data_ptr()  # one copy of the weight


@pytest.mark.parametrize(("at_load", "bound"), [("int8", 0.002), ("int4", 0.05)])
def test_quantizing_a_checkpoint_at_load(synth_llama, at_load, bound):
    """Perplexity of the quantized synthetic model on its own float32 greedy text stays within
    `bound` of the float32 model's. The linears become quantized layers of the chosen format,
    except down_proj, whose 176 inputs are not whole blocks of 32: it stays float."""
    plain = LLM(synth_llama, dtype="float32", quantization="none")
    quantized = LLM(synth_llama, dtype="float32", quantization=at_load)
    fmt = {"int8": "Q8_0", "int4": "Q4_1"}[at_load]
    model = quantized.engine.model
    assert model.config.intermediate_size % 32
    for layer in model.layers:
        linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj]
        # Q4_1 rows come repacked where they are in sixteens (the synthetic model's are)
        want = quant.REPACKED.get(fmt, fmt)
        assert all(isinstance(m, QuantLinear) and m.fmts == [want] * len(m.fmts) for m in linears)
        assert isinstance(layer.mlp.down_proj, nn.Linear)
    prompt = list(range(5, 25))
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    text = prompt + plain.generate([prompt], sp)[0].token_ids
    ppl = [perplexity(m.engine.model, text) for m in (plain, quantized)]
    assert abs(ppl[1] / ppl[0] - 1) < bound, ppl


HELD_TEXT = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light "
    "energy into chemical energy. In the leaves, chlorophyll absorbs sunlight, and the plant uses "
    "that energy to combine carbon dioxide from the air with water from the soil, making glucose "
    "and releasing oxygen. The glucose feeds the plant's growth, and the oxygen is what animals "
    "breathe. A student who remembers one sentence should remember this: plants make their own "
    "food from light, water and air. "
    "Fractions name parts of a whole. In the fraction three quarters, the bottom number says the "
    "whole is cut into four equal pieces and the top number says we take three of them. To add "
    "two fractions, first rewrite them with the same bottom number: one half becomes two "
    "quarters, so one half plus one quarter is three quarters. A common mistake is to add the "
    "tops and the bottoms separately, which would give two sixths, a smaller number than one "
    "half on its own. Drawing the pieces, or cutting a paper strip, shows why that cannot be right."
)


@pytest.mark.slow
def test_the_default_model_on_its_q4_1_blocks_matches_itself_dequantized():
    quantized = LLM(
        "smollm2-135m-instruct", dtype="float32", quantization="auto", kv_cache_bytes=256 << 20
    )
    plain = LLM(
        "smollm2-135m-instruct", dtype="float32", quantization="none", kv_cache_bytes=256 << 20
    )
    model = quantized.engine.model
    # Every layer's Q4_1 rows repacked; the tied Q8_0 head in GGUF's layout (models/weights.py).
    layers = [m for m in model.modules() if isinstance(m, QuantLinear) and m is not model.lm_head]
    assert layers and all(m.fmts == ["Q4_1_R16"] for m in layers)
    assert model.lm_head.fmts == ["Q8_0"]
    ids = quantized.tokenizer.encode(HELD_TEXT)
    # One token a step, as decoding computes them: the matmuls run on the blocks themselves
    # (a chunk of more than their row count multiplies their exact dequantization with
    # PyTorch's GEMM).
    la = forward_logits(quantized.engine.model, ids, chunk=1).double()
    lb = forward_logits(plain.engine.model, ids).double()
    agree = la.argmax(-1) == lb.argmax(-1)
    top2 = lb.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    delta = (la - lb).abs().mean().item()
    print(f"top-1 agreement {agree.double().mean():.4f} of {len(ids)}, mean |dlogit| {delta:.2e}")
    # The matmuls round activations to int8 (one scale per four values): logits move by ~0.06
    # on average, so a near-tie may flip, and which ones do changes with any change in the
    # order of a sum (a value at a rounding boundary of the next layer's int8 codes goes one
    # way or the other): 3 to 6 of these 206 positions, each at a top-2 margin of 0.052 or
    # less, across the levels and layouts. A clear winner may not flip.
    assert agree[margin > 0.1].all(), margin[~agree]
    assert agree.double().mean() >= 0.96 and delta < 0.1, (agree.double().mean(), delta)
    ppl = [perplexity(quantized.engine.model, ids, chunk=1), perplexity(plain.engine.model, ids)]
    assert abs(ppl[0] / ppl[1] - 1) < 0.01, ppl
    # A chunk above the blocks' row count multiplies their exact dequantization.
    long = ids * 2
    assert len(long) > GEMV_ROWS["Q4_1_R16"]
    prefill = forward_logits(quantized.engine.model, long).double()
    assert torch.equal(prefill, forward_logits(plain.engine.model, long).double())
    prompts = [
        quantized.render_chat([{"role": "user", "content": q}])
        for q in ("Explain what photosynthesis is in one sentence.", "What is a prime number?",
                  "Give one tip for learning vocabulary.", "What is 3/4 + 1/8?")
    ]  # fmt: skip
    sp = SamplingParams(temperature=0, max_tokens=24)
    replies = zip(quantized.generate(prompts, sp), plain.generate(prompts, sp), strict=True)
    for prompt, (a, b) in zip(prompts, replies, strict=True):
        if a.token_ids == b.token_ids:
            continue
        # where they part (one may end first: then the other's next token parts them)
        pairs = enumerate(zip(a.token_ids, b.token_ids, strict=False))
        common = next((i for i, (x, y) in pairs if x != y), min(len(a.token_ids), len(b.token_ids)))
        # The replies part at a near-tie of the dequantized model (as above), not at a clear
        # choice.
        context = quantized.tokenizer.encode(prompt) + b.token_ids[:common]
        top2 = forward_logits(plain.engine.model, context)[-1].topk(2).values
        assert top2[0] - top2[1] < 0.1, (prompt, common, top2)


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_the_roofline_reads_the_weights_as_loaded(synth_llama, synth_qwen2, quantization):
    """Bytes a decode step reads, counted by hand from the shapes: float32 parameters at 4
    bytes, Q4_1 blocks at 20 bytes per 32 weights; the input embedding only when tied (it is
    then the LM head)."""
    for folder in (synth_llama, synth_qwen2):
        model = LLM(folder, dtype="float32", quantization=quantization).engine.model
        cfg = model.config
        h, i, q = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
        kv = cfg.num_kv_heads * cfg.head_dim
        # whole blocks of 32 inputs: qkv, o, gate/up (down's 176 inputs are not)
        blocked = h * (q + 2 * kv) + q * h + 2 * i * h
        other = i * h + 2 * h + (q + 2 * kv) * model.arch.qkv_bias
        per_layer = blocked * (20 / 32 if quantization == "int4" else 4) + other * 4
        head = cfg.vocab_size * h * 4
        assert weight_bytes(model) == cfg.num_layers * per_layer + head + h * 4
        if quantization == "none":  # the config-only bound counts the same bytes, but biases
            m = Machine(bandwidth_gbs=1.0, bf16_gflops=1e9)
            bound = decode_bound(cfg, m, 1, 0, 4)
            assert bound == pytest.approx(1e9 / weight_bytes(model), rel=0.005)
