"""Grammar engines for structured outputs, measured on our tokenizer: xgrammar vs llguidance.

For each library: tokenizer-info build, compile time of four grammars (a JSON schema, any JSON
object, a regex, a choice), the per-token cost of the allowed-token bitmask while walking a
valid output (one matcher, and 32 matchers filling a [32, words] bitmask with the library's
batched API), the cost of applying a bitmask to float32 logits [B, vocab] (each library's
helper and three plain ways), whether the batched fill lets other Python threads run, and how
the matcher behaves on rollback, EOS, a disallowed token and invalid grammars.

    .venv/bin/python bench/grammar_mask.py --passes 7      # both libraries, ~25 s
    .venv/bin/python bench/grammar_mask.py --libs llguidance --passes 3 --batch 8

Needs both libraries with torch pinned: `echo torch==2.13.0 > /tmp/c.txt;
.venv/bin/pip install -c /tmp/c.txt xgrammar==0.2.9 llguidance==1.9.1`. Times are medians
over passes (fresh matchers: what a new request sees; re-walked: warm caches); the machine's
cores may be shared with other work, so rerun before trusting a small difference. torch runs
on one intra-op thread (--torch-threads), the libraries' pools on --threads. Prints markdown
tables and nothing else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tutorserve.models.loader import load_tokenizer
from tutorserve.models.registry import DEFAULT_MODEL
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.structured import apply_bitmask

log = logging.getLogger("grammar_mask")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "level": {"enum": ["beginner", "intermediate", "advanced"]},
        "topics": {"type": "array", "items": {"type": "string"}},
        "tutor": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "subject": {"type": "string"}},
            "required": ["id", "subject"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "level", "topics", "tutor"],
    "additionalProperties": False,
}
JSON_TEXT = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "level": "advanced",
        "topics": ["algebra", "calculus", "analytical engines"],
        "tutor": {"id": 1815, "subject": "mathematics of the engine"},
    }
)
REGEX, REGEX_TEXT = r"\d{3}-[a-z]+", "123-abc"
CHOICES, CHOICE_TEXT = ["positive", "negative", "neutral"], "neutral"
# grammar name → (the output walked through it)
GRAMMARS = {
    "json_schema": JSON_TEXT,
    "json_object": JSON_TEXT,
    "regex": REGEX_TEXT,
    "choice": CHOICE_TEXT,
}
BAD_SCHEMA = {"type": "object", "properties": 5}
BAD_REGEX = "[a-"


def _ns() -> int:
    return time.perf_counter_ns()


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _p90(xs: list[float]) -> float:
    return float(np.percentile(xs, 90)) if xs else float("nan")


def _allowed(bitmask: torch.Tensor, row: int, n: int) -> list[int]:
    bits = np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:n]
    return np.flatnonzero(bits).tolist()


class Engine:
    """One library behind the few calls the bench needs."""

    name = ""

    def __init__(self, tok: Tokenizer, vocab: int, threads: int) -> None:
        self.tok, self.vocab, self.threads = tok, vocab, threads

    def build_info(self) -> None: ...
    def compile(self, kind: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None: ...
    def accept(self, m: Any, token: int) -> bool: ...
    def accept_batch(self, ms: list[Any], tokens: list[int]) -> list[bool]: ...
    def reset(self, m: Any) -> None: ...
    def rollback(self, m: Any, n: int) -> Any: ...
    def done(self, m: Any) -> bool: ...
    def completed(self, m: Any) -> bool: ...
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None: ...
    def invalid(self, kind: str, text: Any) -> str: ...


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int, threads: int) -> None:
        super().__init__(tok, vocab, threads)
        import xgrammar as xgr

        self.xgr = xgr

    def build_info(self) -> None:
        xgr, tok = self.xgr, self.tok
        encoded = [""] * self.vocab
        for piece, i in tok._tok.get_vocab(with_added_tokens=True).items():
            if i < self.vocab:
                encoded[i] = piece
        for i, added in tok._tok.get_added_tokens_decoder().items():
            # an empty piece marks a special token: never allowed by a grammar; otherwise
            # "<|im_start|>" would be allowed as plain text inside a JSON string
            if added.special and i not in tok.eos_token_ids and i < self.vocab:
                encoded[i] = ""
        self.info = xgr.TokenizerInfo(
            encoded,
            xgr.VocabType.BYTE_LEVEL,
            vocab_size=self.vocab,
            stop_token_ids=tok.eos_token_ids,
            add_prefix_space=False,
        )
        self.compiler = xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )
        self.batcher = xgr.BatchGrammarMatcher(max_threads=self.threads)

    def compile(self, kind: str) -> Any:
        c = self.compiler
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(SCHEMA))
        if kind == "json_object":
            return c.compile_json_schema(json.dumps({"type": "object"}))
        if kind == "regex":
            return c.compile_regex(REGEX)
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(x) for x in CHOICES))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.batcher.batch_fill_next_token_bitmask(ms, bitmask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def accept_batch(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)

    def reset(self, m: Any) -> None:
        m.reset()

    def rollback(self, m: Any, n: int) -> Any:
        return m.rollback(n)

    def done(self, m: Any) -> bool:
        return m.is_terminated()

    def completed(self, m: Any) -> bool:
        return m.is_completed()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)

    def invalid(self, kind: str, text: Any) -> str:
        try:
            if kind == "schema":
                self.compiler.compile_json_schema(json.dumps(text))
            else:
                self.compiler.compile_regex(text)
        except Exception as e:
            return f"raises {type(e).__name__}: {str(e).strip().splitlines()[0]}"
        return "accepted (no error)"


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int, threads: int) -> None:
        super().__init__(tok, vocab, threads)
        import llguidance as llg
        import llguidance.torch as llt

        self.llg, self.llt = llg, llt

    def build_info(self) -> None:
        self.lltok = self.llg.LLTokenizer(
            self.tok._tok.to_str(), n_vocab=self.vocab, eos_token=self.tok.eos_token_ids
        )
        self.executor = self.llg.LLExecutor(num_threads=self.threads)

    def compile(self, kind: str) -> Any:
        """llguidance compiles when the matcher is built, so "compiled" is a template matcher;
        `matcher` makes fresh ones from its grammar string (what a new request does)."""
        llg = self.llg
        if kind == "json_schema":
            grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(REGEX)
        else:
            grammar = llg.grammar_from("choice", json.dumps(CHOICES))
        m = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.lltok, compiled, log_level=0)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        self.llt.fill_next_token_bitmask(m, bitmask, row)

    def fill_batch(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(
            self.executor, list(zip(ms, range(len(ms)), strict=True)), bitmask
        )

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def accept_batch(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens, strict=True)))

    def reset(self, m: Any) -> None:
        m.reset()

    def rollback(self, m: Any, n: int) -> Any:
        return m.rollback(n)

    def done(self, m: Any) -> bool:
        return m.is_stopped()

    def completed(self, m: Any) -> bool:
        return m.is_accepting()

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llt.apply_token_bitmask_inplace(logits, bitmask)

    def invalid(self, kind: str, text: Any) -> str:
        llg = self.llg
        try:
            if kind == "schema":
                grammar = llg.LLMatcher.grammar_from_json_schema(text)
            else:
                grammar = llg.LLMatcher.grammar_from_regex(text)
            m = llg.LLMatcher(self.lltok, grammar, log_level=0)
        except Exception as e:
            return f"raises {type(e).__name__}: {str(e).strip().splitlines()[0]}"
        if m.is_error():
            first = m.get_error().strip().splitlines()[0]
            return f"no exception; matcher.is_error(), get_error()={first!r}"
        return "accepted (no error)"


ENGINES: dict[str, type[Engine]] = {"xgrammar": XGrammar, "llguidance": LLGuidance}


@dataclass
class Result:
    lib: str
    info_ms: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    first_mask_ms: dict[str, float] = field(default_factory=dict)
    # grammar → (cold median, cold p90, warm median, warm p90, accept median) µs per token
    single: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # grammar → (batched median, p90, looped median, p90) µs per step of the whole batch
    batch: dict[str, tuple[float, ...]] = field(default_factory=dict)
    apply_us: dict[tuple[str, int], float] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    apply_first_ms: float = 0.0
    gil: dict[str, float] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)


def _timed(f: Callable[[], Any]) -> tuple[float, Any]:
    t0 = _ns()
    out = f()
    return (_ns() - t0) / 1e6, out


def _walk(eng: Engine, m: Any, ids: list[int], bitmask: torch.Tensor) -> tuple[list, list]:
    """Fill the mask, check the next token is allowed, accept it; then EOS. µs per step."""
    fills, accepts = [], []
    for tok in ids:
        t0 = _ns()
        eng.fill(m, bitmask, 0)
        t1 = _ns()
        if not (bitmask[0, tok // 32].item() >> (tok % 32)) & 1:
            raise AssertionError(f"{eng.name}: token {tok} masked out")
        t2 = _ns()
        if not eng.accept(m, tok):
            raise AssertionError(f"{eng.name}: token {tok} not accepted")
        accepts.append((_ns() - t2) / 1e3)
        fills.append((t1 - t0) / 1e3)
    return fills, accepts


def bench_engine(name: str, tok: Tokenizer, args: argparse.Namespace, bar: tqdm) -> Result:
    vocab = args.vocab or tok.vocab_size
    eng = ENGINES[name](tok, vocab, args.threads)
    res = Result(name)
    res.info_ms, _ = _timed(eng.build_info)
    eos = tok.eos_token_ids[0]
    width = (vocab + 31) // 32
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    compiled: dict[str, Any] = {}
    for kind, text in GRAMMARS.items():
        times, firsts = [], []
        for _ in range(args.passes):
            ms, compiled[kind] = _timed(lambda k=kind: eng.compile(k))
            times.append(ms)
            m = eng.matcher(compiled[kind])
            fm, _ = _timed(lambda m=m: eng.fill(m, bitmask, 0))
            firsts.append(ms + fm)
        res.compile_ms[kind], res.first_mask_ms[kind] = _median(times), _median(firsts)
        bar.update()

        ids = tok.encode(text, add_special_tokens=False)
        cold, warm, acc = [], [], []
        for _ in range(args.passes):  # a fresh matcher: what a new request sees
            f, a = _walk(eng, eng.matcher(compiled[kind]), ids, bitmask)
            cold += f
            acc += a
        m = eng.matcher(compiled[kind])
        _walk(eng, m, ids, bitmask)
        for _ in range(args.passes):  # the same matcher again: whatever it caches is warm
            eng.reset(m)
            f, a = _walk(eng, m, ids, bitmask)
            warm += f
            acc += a
        res.single[kind] = (_median(cold), _p90(cold), _median(warm), _p90(warm), _median(acc))
        res.notes[f"{kind}_tokens"] = str(len(ids))
        bar.update()

        if kind in ("json_schema", "json_object"):
            res.batch[kind] = _batch(eng, compiled[kind], ids, args.batch, width, args.passes)
            bar.update()

    _behaviour(eng, res, compiled["json_schema"], tok.encode(JSON_TEXT), eos, bitmask)
    res.masks = sample_masks(eng, compiled["json_schema"], tok.encode(JSON_TEXT), width)
    first = res.masks["few allowed"].clone()
    res.apply_first_ms, _ = _timed(lambda: eng.apply(torch.randn(1, vocab), first))
    res.apply_us = time_apply(eng.apply, res.masks, vocab, args.batch, args.apply_iters)
    bar.update()
    _gil(eng, res, compiled["json_schema"], tok.encode(JSON_TEXT), args.batch, width)
    bar.update()
    return res


def _batch(
    eng: Engine, compiled: Any, ids: list[int], batch: int, width: int, passes: int
) -> tuple[float, ...]:
    bitmask = torch.full((batch, width), -1, dtype=torch.int32)
    batched: list[float] = []
    looped: list[float] = []
    for p in range(passes):
        for use_batch in (True, False) if p % 2 == 0 else (False, True):
            ms = [eng.matcher(compiled) for _ in range(batch)]  # fresh, as new requests
            for tok in ids:
                t0 = _ns()
                if use_batch:
                    eng.fill_batch(ms, bitmask)
                else:
                    for i, m in enumerate(ms):
                        eng.fill(m, bitmask, i)
                (batched if use_batch else looped).append((_ns() - t0) / 1e3)
                col = bitmask[:, tok // 32] >> (tok % 32) & 1
                if not bool(col.all()) or not all(eng.accept_batch(ms, [tok] * batch)):
                    raise AssertionError(f"{eng.name}: a row rejected token {tok}")
    return _median(batched), _p90(batched), _median(looped), _p90(looped)


def _behaviour(
    eng: Engine, res: Result, compiled: Any, ids: list[int], eos: int, bitmask: torch.Tensor
) -> None:
    n = len(ids)
    m = eng.matcher(compiled)
    masks = []
    for tok in ids:
        eng.fill(m, bitmask, 0)
        masks.append(bitmask.clone())
        eng.accept(m, tok)
    eng.fill(m, bitmask, 0)
    only = _allowed(bitmask, 0, eng.vocab)
    res.notes["complete"] = f"completed={eng.completed(m)}; mask allows {only[:4]}"
    # roll back the last 10 tokens and re-walk them: same masks?
    r = eng.rollback(m, 10)
    same = True
    for i in range(n - 10, n):
        eng.fill(m, bitmask, 0)
        same &= torch.equal(bitmask, masks[i])
        eng.accept(m, ids[i])
    res.notes["rollback"] = f"rollback(10) -> {r!r}; masks after re-walk identical: {same}"
    eng.fill(m, bitmask, 0)
    ok = eng.accept(m, eos)
    res.notes["eos"] = f"accept(EOS)={ok}, finished={eng.done(m)}"
    eng.rollback(m, 1)
    res.notes["eos_rollback"] = f"finished={eng.done(m)}, completed={eng.completed(m)}"
    # a disallowed token at the start
    m = eng.matcher(compiled)
    bad = eng.tok.encode("x", add_special_tokens=False)[0]
    got = eng.accept(m, bad)
    then = eng.accept(m, ids[0])
    eng.reset(m)
    again = eng.accept(m, ids[0])
    res.notes["bad_token"] = (
        f"accept(bad)={got}; then a valid token -> {then}; after reset() -> {again}"
    )
    # too-far rollback
    try:
        out = eng.rollback(m, 1000)
        res.notes["rollback_too_far"] = f"returns {out!r}"
    except Exception as e:
        res.notes["rollback_too_far"] = f"raises {type(e).__name__}"
    # a special token (<|im_start|>) inside a JSON string
    m = eng.matcher(compiled)
    special = eng.tok.encode('{"name": "x', add_special_tokens=False)
    for tok in special:
        eng.accept(m, tok)
    eng.fill(m, bitmask, 0)
    im_start = eng.tok._tok.token_to_id("<|im_start|>")
    allowed = bool((bitmask[0, im_start // 32].item() >> (im_start % 32)) & 1)
    res.notes["special_in_string"] = f"<|im_start|> allowed inside a string: {allowed}"
    res.notes["bad_schema"] = eng.invalid("schema", BAD_SCHEMA)
    res.notes["bad_regex"] = eng.invalid("regex", BAD_REGEX)


def sample_masks(eng: Engine, compiled: Any, ids: list[int], width: int) -> dict[str, Any]:
    """Two masks from the schema walk: before the first token (a handful of tokens allowed,
    so applying writes -inf nearly everywhere) and inside a string value (nearly all allowed)."""
    masks = {}
    m = eng.matcher(compiled)
    for label, upto in (("few allowed", 0), ("most allowed", 5)):
        eng.reset(m)
        for tok in ids[:upto]:
            eng.accept(m, tok)
        row = torch.full((1, width), -1, dtype=torch.int32)
        eng.fill(m, row, 0)
        masks[label] = row
    return masks


def time_apply(
    apply: Callable[[torch.Tensor, torch.Tensor], None],
    masks: dict[str, torch.Tensor],
    vocab: int,
    batch: int,
    iters: int,
) -> dict[tuple[str, int], float]:
    """µs to apply each mask, repeated over `batch` rows, to logits [batch, vocab]; checked
    against a plain reference."""
    out = {}
    for label, row in masks.items():
        for b in (1, batch):
            bitmask = row.expand(b, row.shape[1]).contiguous()
            logits = torch.randn(b, vocab)
            want = logits.clone()
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
            want[torch.from_numpy(bits[:, :vocab]) == 0] = float("-inf")
            apply(logits, bitmask)
            if not torch.equal(logits, want):
                raise AssertionError(f"{apply!r} applied the mask wrongly")
            times = []
            for _ in range(iters):
                t0 = _ns()
                apply(logits, bitmask)
                times.append((_ns() - t0) / 1e3)
            out[label, b] = _median(times)
    return out


SHIFTS = torch.arange(32, dtype=torch.int32)
# byte value → the 8 logits' additive mask (0 allowed, -inf not)
BYTE_LUT = torch.tensor(
    [[0.0 if (v >> i) & 1 else float("-inf") for i in range(8)] for v in range(256)]
)


def shift_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch: unpack with a shift table, masked_fill_."""
    b, v = logits.shape
    bits = (bitmask.unsqueeze(-1) >> SHIFTS).bitwise_and_(1).view(b, -1)[:, :v]
    logits.masked_fill_(bits == 0, float("-inf"))


def lut_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain torch: gather a 0/-inf row per mask byte from a [256, 8] table, add_."""
    b, v = logits.shape
    logits.add_(BYTE_LUT[bitmask.view(torch.uint8).long()].view(b, -1)[:, :v])


def numpy_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """numpy.unpackbits, masked_fill_."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    logits.masked_fill_(torch.from_numpy(bits[:, : logits.shape[1]]) == 0, float("-inf"))


def kernel_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """What our engine runs on CPUs: the one-pass C kernel (kernels/bitmask.c)."""
    apply_bitmask(logits, bitmask, list(range(logits.shape[0])))


PLAIN_APPLY = {
    "tutorserve: kernels/bitmask.c": kernel_apply,
    "torch shift table + masked_fill_": shift_apply,
    "torch byte table (0/-inf) gather + add_": lut_apply,
    "numpy unpackbits + masked_fill_": numpy_apply,
}


def _gil(eng: Engine, res: Result, compiled: Any, ids: list[int], batch: int, width: int) -> None:
    """How fast a pure-Python thread counts while this thread fills masks, against while it
    sleeps: ~1 means the fill gives up the GIL."""
    count = [0]
    stop = threading.Event()

    def counter() -> None:
        while not stop.is_set():
            count[0] += 1

    def rate(work: Callable[[], None], seconds: float = 0.4) -> float:
        start, t0 = count[0], time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            work()
        return (count[0] - start) / (time.perf_counter() - t0)

    ms = [eng.matcher(compiled) for _ in range(batch)]
    for m in ms:
        for tok in ids[:5]:
            eng.accept(m, tok)
    bitmask = torch.full((batch, width), -1, dtype=torch.int32)
    c0, w0 = time.process_time(), time.perf_counter()
    while time.perf_counter() - w0 < 0.4:
        eng.fill_batch(ms, bitmask)
    res.gil["cpu_per_wall"] = (time.process_time() - c0) / (time.perf_counter() - w0)
    th = threading.Thread(target=counter, daemon=True)
    th.start()
    try:
        idle = rate(lambda: time.sleep(0.01))
        res.gil["python_busy"] = rate(lambda: sum(range(20_000))) / idle
        res.gil["fill_batch"] = rate(lambda: eng.fill_batch(ms, bitmask)) / idle
        res.gil["fill_single"] = rate(lambda: eng.fill(ms[0], bitmask, 0)) / idle
    finally:
        stop.set()
        th.join()


def _fmt(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def table(results: list[Result], plain: dict[str, dict], args: argparse.Namespace) -> str:
    libs = [r.lib for r in results]
    b = args.batch
    lines = ["| measurement | " + " | ".join(libs) + " |", "|---|" + "---|" * len(libs)]

    def row(label: str, cell: Callable[[Result], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(r) for r in results) + " |")

    row("tokenizer info build (ms)", lambda r: _fmt(r.info_ms, 1))
    for kind in GRAMMARS:
        row(f"compile {kind} (ms)", lambda r, k=kind: _fmt(r.compile_ms[k], 2))
    for kind in GRAMMARS:
        row(f"compile + first mask {kind} (ms)", lambda r, k=kind: _fmt(r.first_mask_ms[k], 2))
    for kind in GRAMMARS:
        n = results[0].notes[f"{kind}_tokens"]
        row(
            f"B=1 mask µs/token {kind} ({n} tok), fresh matcher: p50 / p90",
            lambda r, k=kind: f"{_fmt(r.single[k][0], 1)} / {_fmt(r.single[k][1], 1)}",
        )
        row(
            f"B=1 mask µs/token {kind}, same matcher re-walked: p50 / p90",
            lambda r, k=kind: f"{_fmt(r.single[k][2], 1)} / {_fmt(r.single[k][3], 1)}",
        )
    row(
        "B=1 accept µs/token (all grammars, p50)",
        lambda r: _fmt(_median([v[4] for v in r.single.values()]), 1),
    )
    for kind in ("json_schema", "json_object"):
        row(
            f"B={b} batched fill µs/step {kind}: p50 / p90 (per row p50)",
            lambda r, k=kind: (
                f"{_fmt(r.batch[k][0])} / {_fmt(r.batch[k][1])} ({_fmt(r.batch[k][0] / b, 1)})"
            ),
        )
        row(
            f"B={b} loop of single fills µs/step {kind}: p50 / p90",
            lambda r, k=kind: f"{_fmt(r.batch[k][2])} / {_fmt(r.batch[k][3])}",
        )
    row(
        "batched fill: CPU time / wall time (>1: runs on several cores)",
        lambda r: f"{r.gil['cpu_per_wall']:.2f}",
    )
    row(
        "speed of another Python thread during: batched fill / single fill / pure-Python "
        "control (1 = GIL released, ~0.5 = held)",
        lambda r: (
            f"{r.gil['fill_batch']:.2f} / {r.gil['fill_single']:.2f} / {r.gil['python_busy']:.2f}"
        ),
    )
    for label in ("few allowed", "most allowed"):
        row(
            f"apply helper µs, mask with {label}, B=1 / B={b}",
            lambda r, k=label: f"{_fmt(r.apply_us[k, 1], 1)} / {_fmt(r.apply_us[k, b], 1)}",
        )
    row("apply helper first call (ms)", lambda r: _fmt(r.apply_first_ms, 1))
    for key, label in (
        ("complete", "after the whole JSON"),
        ("eos", "accept EOS"),
        ("rollback", "rollback 10 tokens and re-walk"),
        ("eos_rollback", "after EOS, rollback(1)"),
        ("rollback_too_far", "rollback(1000) after 1 token"),
        ("bad_token", "disallowed token"),
        ("special_in_string", "special token in a JSON string"),
        ("bad_schema", f"invalid schema {json.dumps(BAD_SCHEMA)}"),
        ("bad_regex", f"invalid regex {BAD_REGEX!r}"),
    ):
        row(label, lambda r, k=key: r.notes[k].replace("|", "\\|"))
    out = ["\n".join(lines), "", f"| plain apply (µs), B=1 / B={b} | few allowed | most allowed |"]
    out.append("|---|---|---|")
    for label, t in plain.items():
        cells = [
            f"{_fmt(t[k, 1], 1)} / {_fmt(t[k, b], 1)}" for k in ("few allowed", "most allowed")
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--libs", default="xgrammar,llguidance")
    ap.add_argument("--passes", type=int, default=5, help="repeats of each measurement")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="the libraries' worker threads"
    )
    ap.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--apply-iters", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=0, help="mask width (default: tokenizer's)")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(message)s",
    )
    # one intra-op thread: with two, a plain torch op on this 2-core box stalls for a whole
    # scheduler slice (~30 ms) whenever another process holds the other core
    torch.set_num_threads(args.torch_threads)
    tok = load_tokenizer(args.model)
    log.info("tokenizer: %d tokens, eos %s", tok.vocab_size, tok.eos_token_ids)
    libs = [x.strip() for x in args.libs.split(",") if x.strip()]
    steps = len(libs) * (2 * len(GRAMMARS) + 2 + 2)
    results = []
    with tqdm(total=steps, desc="grammar bench", unit="step") as bar:
        for name in libs:
            bar.set_postfix_str(name)
            results.append(bench_engine(name, tok, args, bar))
            log.info("%s done", name)
    vocab = args.vocab or tok.vocab_size
    masks = results[0].masks
    plain = {
        label: time_apply(f, masks, vocab, args.batch, args.apply_iters)
        for label, f in PLAIN_APPLY.items()
    }
    print(table(results, plain, args))


if __name__ == "__main__":
    main()
