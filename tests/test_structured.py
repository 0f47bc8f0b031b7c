"""Structured outputs: whatever the model, constrained decoding makes the output match — JSON
schemas (validated by `jsonschema`), regexes, choices and grammars — with constrained and free
rows in one batch."""

import json
import random
import re

import jsonschema
import pytest
import torch

from tutorserve import LLM, SamplingParams
from tutorserve.sampling_params import StructuredOutputs
from tutorserve.structured import apply_bitmask, grammar


def _schema(rng: random.Random, depth: int = 0) -> dict:
    """A random object schema whose every instance is short (so a random model finishes)."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] if depth < 2 else [])
    props = {}
    for i in range(rng.randint(1, 4)):
        kind = rng.choice(kinds)
        if kind == "string":
            props[f"s{i}"] = {"type": "string", "maxLength": rng.randint(0, 6)}
        elif kind == "integer":
            lo = rng.randint(-50, 50)
            props[f"n{i}"] = {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 99)}
        elif kind == "boolean":
            props[f"b{i}"] = {"type": "boolean"}
        elif kind == "enum":
            props[f"e{i}"] = {"enum": rng.sample(["red", "green", "blue", "x y", "é"], 2)}
        elif kind == "array":
            props[f"a{i}"] = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
        else:
            props[f"o{i}"] = _schema(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def llm(synth_llama):
    return LLM(synth_llama, dtype="float32")


def test_fifty_random_schemas_are_obeyed_in_one_batch(llm):
    rng = random.Random(0)
    schemas = [_schema(rng) for _ in range(50)]
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(2, 20))] for _ in range(55)]
    params = [
        SamplingParams(max_tokens=400, seed=i, structured=StructuredOutputs(json=json.dumps(s)))
        for i, s in enumerate(schemas)
    ]
    params += [SamplingParams(max_tokens=20, seed=i) for i in range(5)]  # free rows alongside
    outs = llm.generate(prompts, params)
    for schema, out in zip(schemas, outs, strict=False):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert any(not _is_json(o.text) for o in outs[50:])  # the free rows really were free


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputs(regex=r"\d{3}-[a-z]{2,5}"),
         lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (StructuredOutputs(choice=("maths", "physics", "art history")),
         lambda t: t in {"maths", "physics", "art history"}),
        (StructuredOutputs(grammar='start: "x=" NUM ("+" NUM)?\nNUM: /[0-9]{1,3}/'),
         lambda t: re.fullmatch(r"x=[0-9]{1,3}(\+[0-9]{1,3})?", t)),
        (StructuredOutputs(grammar='root ::= "yes" | "no" | "maybe"'),  # GBNF
         lambda t: t in {"yes", "no", "maybe"}),
    ],
)  # fmt: skip
def test_json_object_regex_choice_and_grammars(llm, spec, check):
    outs = llm.generate(
        [[5, 6, 7], [9, 10, 11, 12]],
        [SamplingParams(max_tokens=300, seed=s, structured=spec) for s in (1, 2)],
    )
    for out in outs:
        assert out.finish_reason == "stop"
        assert check(out.text), out.text


def test_greedy_constrained_output_is_the_best_allowed_token_each_step(llm):
    """Temperature 0 under a choice: the model's own preference among the allowed tokens."""
    spec = StructuredOutputs(choice=("ab", "ba"))
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=10, logprobs=2,
                                                   structured=spec))[0]  # fmt: skip
    assert out.text in {"ab", "ba"}
    for lp in out.logprobs:  # a masked row: the best alternative is the token taken
        assert lp.top[0][0] == lp.token_id


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutputs(json='{"type": "object", "properties": 5}'),
        StructuredOutputs(json="{not json"),
        StructuredOutputs(regex="[a-"),
        StructuredOutputs(grammar="start: undefined_rule"),
    ],
)
def test_bad_grammars_are_refused_with_the_reason(llm, spec):
    with pytest.raises(ValueError, match=r".{8,}"):
        llm.engine.grammars.matcher(spec)
    with pytest.raises(ValueError):
        llm.engine.add_request("bad", [1, 2], SamplingParams(structured=spec))
    assert not llm.engine.seqs and llm.engine.kv.num_used_blocks == 0


def test_structured_outputs_take_exactly_one_kind():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()


def test_apply_bitmask_in_the_cpu_kernel(cpu_isa):
    """At each ISA level this CPU runs."""
    _check_apply_bitmask()


def test_apply_bitmask_unpacking_as_on_gpus(monkeypatch):
    monkeypatch.setattr(grammar, "apply_token_bitmask", lambda *a: False)
    _check_apply_bitmask()


def _check_apply_bitmask():
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    allowed = torch.rand(3, vocab, generator=g) < 0.3
    allowed[1] = True  # every word full: skipped
    allowed[2, :64] = False  # whole words empty
    words = torch.zeros(3, 4, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement
    logits = torch.randn(5, vocab, generator=g)
    out = logits.clone()
    apply_bitmask(out, bitmask, [4, 0, 2])  # mask row i applies to logits row rows[i]
    for mask_row, row in ((0, 4), (1, 0), (2, 2)):
        keep = allowed[mask_row]
        assert torch.equal(out[row, keep], logits[row, keep])
        assert torch.isneginf(out[row, ~keep]).all()
    assert torch.equal(out[[1, 3]], logits[[1, 3]])  # rows without a mask untouched


def test_the_tutor_diagnosis_always_comes_in_its_form(synth_llama):
    """The diagnose agent's reply is constrained to a JSON object with a label of the set, so
    even a random model's reply is one the agent can use."""
    import asyncio

    from tutorserve.config import EngineConfig
    from tutorserve.engine.async_engine import AsyncEngine
    from tutorserve.engine.engine import LLMEngine
    from tutorserve.tutor.agents.diagnose import parse
    from tutorserve.tutor.llm_client import EngineLLM, complete
    from tutorserve.tutor.prompts import DIAGNOSIS_SCHEMA, ERROR_LABELS

    server = AsyncEngine(
        lambda: LLMEngine(EngineConfig.from_kwargs(model=synth_llama, dtype="float32"))
    )

    async def run():
        await server.start()
        llm = EngineLLM(server, "tiny")
        messages = [{"role": "user", "content": "Classify the mistake: 2 + 2 = 5"}]
        texts = [
            await complete(llm, messages, max_tokens=60, temperature=1.0, schema=DIAGNOSIS_SCHEMA)
            for _ in range(3)
        ]
        await server.stop()
        return texts

    for text in asyncio.run(run()):
        found = parse(text)
        assert found is not None and found[0] in ERROR_LABELS, text


def test_a_draft_bitmask_row_is_the_mask_after_the_drafts_before_it(llm):
    """What a row verifying drafts masks its logits with: row j is what the grammar allows
    once the first j drafts are taken; the matcher ends where it began."""
    spec = StructuredOutputs(json='{"type": "object", "properties": {"n": {"type": "integer"}}}')
    vocab = llm.engine.model.config.vocab_size
    text = llm.engine.tokenizer.encode('{"n":12}')  # compact: no free whitespace
    matcher = llm.engine.grammars.matcher(spec)
    assert matcher.valid_prefix(text) == len(text)
    assert matcher.valid_prefix([*text[:2], 0, *text[2:]]) == 2  # token 0 breaks the JSON
    masks = matcher.draft_bitmask(text, vocab)
    assert torch.equal(grammar.fill_bitmask([matcher], vocab)[0], masks[0])
    for j in range(1, len(text) + 1):
        step = llm.engine.grammars.matcher(spec)
        assert all(step.accept(t) for t in text[:j])
        assert torch.equal(grammar.fill_bitmask([step], vocab)[0], masks[j])
    assert not torch.equal(masks[0], masks[1])
    with pytest.raises(ValueError, match="not allowed"):
        matcher.draft_bitmask([text[0], 0], vocab)
    assert torch.equal(grammar.fill_bitmask([matcher], vocab)[0], masks[0])
