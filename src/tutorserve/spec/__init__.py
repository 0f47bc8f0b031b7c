"""Speculative decoding's proposers: each drafts the next few tokens of a decode row from what
it has seen, for the engine to verify in one forward (several query tokens per row) and keep the
longest prefix the model itself would have produced (`engine/sampler.py: verify`)."""

from tutorserve.spec.ngram import NgramProposer
from tutorserve.spec.proposer import Proposer, scope_key
from tutorserve.spec.suffix import SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}


def proposer_named(name: str) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(f"speculative must be one of {', '.join(PROPOSERS)}, got {name!r}")
    return PROPOSERS[name]()


__all__ = [
    "PROPOSERS", "NgramProposer", "Proposer", "SuffixProposer", "proposer_named", "scope_key",
]  # fmt: skip
