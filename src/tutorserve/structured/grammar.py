"""llguidance behind a small interface: compile (cached, checked), match, mask.

llguidance was chosen over xgrammar by measurement (bench/grammar_mask.py, docs/benchmarks/
structured.md): both compute a step's mask in microseconds, but xgrammar needs transformers at
import and pulls in triton, while llguidance has no dependencies and reads our `tokenizers`
tokenizer as it is. Its torch helper is not used: importing it costs ~2 s and its first call
runs torch.compile; on CPUs our kernel applies the mask in one pass (`kernels/bitmask.c`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance as llg
import numpy as np
import torch

from tutorserve.kernels.bitmask import apply_token_bitmask
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sampling_params import StructuredOutputs

# JSON without free whitespace: a model cannot pad a reply with blanks until max_tokens, and
# a reply costs fewer tokens (what vLLM's disable-any-whitespace option does).
_COMPACT = {"whitespace_flexible": False}
_CACHE_SIZE = 256  # compiled grammars kept (a course's few schemas, each request's choices)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher: llg.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Follow an emitted token; False if the grammar does not allow it."""
        return self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing but the end of the output can follow."""
        return self._m.is_stopped()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here (it stays here)."""
        return self._m.validate_tokens(tokens)

    def draft_bitmask(self, drafts: list[int], vocab_size: int) -> torch.Tensor:
        """Row j: the tokens allowed after the first j of `drafts` (a row verifying them has a
        logit row at each); the drafts must be a `valid_prefix`. The matcher ends where it began."""
        # Checked first: a refused token would leave the matcher in its error state.
        if (n := self.valid_prefix(drafts)) < len(drafts):
            raise ValueError(f"draft {n} ({drafts[n]}) is not allowed by the grammar")
        bitmask = _empty_bitmask(len(drafts) + 1, vocab_size)
        for j in range(len(drafts) + 1):
            self._m.unsafe_compute_mask_ptr(bitmask[j].data_ptr(), bitmask.shape[1] * 4)
            if j < len(drafts):
                self._m.consume_token(drafts[j])
        self._m.rollback(len(drafts))
        return bitmask


class GrammarCompiler:
    """Compiles structured-output requests for one tokenizer; safe to call from any thread
    (the server checks a request on its own thread before the engine thread takes it)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's, which may exceed the tokenizer's
        self._lock = threading.Lock()
        self._lltok: llg.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutputs, llg.LLMatcher] = OrderedDict()

    def _ll_tokenizer(self) -> llg.LLTokenizer:
        if self._lltok is None:  # ~0.25 s, so only once a request needs it
            self._lltok = llg.LLTokenizer(
                self._tokenizer.backend.to_str(),
                n_vocab=self.vocab_size,
                eos_token=self._tokenizer.eos_token_ids,
            )
        return self._lltok

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh matcher for `spec`; ValueError naming the problem if it does not compile."""
        with self._lock:
            template = self._cache.get(spec)
            if template is None:
                template = self._compile(spec)
                self._cache[spec] = template
                if len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
            return Matcher(template.deep_copy())

    def _compile(self, spec: StructuredOutputs) -> llg.LLMatcher:
        grammar = _grammar(spec)
        lltok = self._ll_tokenizer()
        error = llg.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(error)
        matcher = llg.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher


def _grammar(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        try:
            schema = json.loads(spec.json)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, dict | bool):
            raise ValueError("a JSON schema must be an object or a boolean")
        return llg.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if spec.json_object:
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_COMPACT)
    if spec.regex is not None:
        # "dw": \d and \w are ASCII, as in the JavaScript and Python regexes clients write.
        return llg.LLMatcher.grammar_from_regex(llg.regex_to_lark(spec.regex, "dw"))
    if spec.choice is not None:
        return llg.grammar_from("choice", json.dumps(list(spec.choice)))
    return llg.grammar_from("grammar", spec.grammar)


def _empty_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    return torch.empty((rows, (vocab_size + 31) // 32), dtype=torch.int32)


def fill_bitmask(matchers: list[Matcher], vocab_size: int) -> torch.Tensor:
    """Row i: the tokens matcher i allows next, one bit each (bit j of word w: token 32w + j)."""
    bitmask = _empty_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        m._m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), bitmask.shape[1] * 4)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Disallowed tokens of logits[rows[i]] (bitmask row i) to -inf, in place."""
    index = torch.tensor(rows, dtype=torch.int64)
    if apply_token_bitmask(logits, bitmask, index):
        return
    # Elsewhere (GPUs, no compiler): unpack the bits and mask.
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    allowed = torch.from_numpy(bits).to(device=logits.device, dtype=torch.bool)
    index = index.to(logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
