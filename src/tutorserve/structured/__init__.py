"""Structured outputs: JSON schemas, regexes, choices and grammars compiled for the model's
tokenizer (by llguidance), and per-request matchers that give each step's allowed tokens as a
bitmask for the sampler and follow the tokens the request emits."""

from tutorserve.structured.grammar import GrammarCompiler, Matcher, apply_bitmask, fill_bitmask

__all__ = ["GrammarCompiler", "Matcher", "apply_bitmask", "fill_bitmask"]
