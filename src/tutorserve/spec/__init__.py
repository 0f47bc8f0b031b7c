"""Speculative decoding's proposers: each drafts the next few tokens of a decode row from what
it has seen, for the engine to verify in one forward (several query tokens per row) and keep the
longest prefix the model itself would have produced (`engine/sampler.py: verify`); and the
back-off policies that say at which batch sizes drafting pays (`backoff.py`)."""

from tutorserve.spec.draft import DraftProposer
from tutorserve.spec.ngram import NgramProposer
from tutorserve.spec.proposer import Proposer, scope_key
from tutorserve.spec.suffix import SuffixProposer

PROPOSERS: dict[str, type[Proposer]] = {"ngram": NgramProposer, "suffix": SuffixProposer}
DRAFT = "draft:"  # `draft:<model>`: a draft model, which the engine loads (`DraftProposer.load`)


def draft_model_name(speculative: str) -> str | None:
    """The model of a `draft:<model>` option; None for a proposer without a model."""
    if not speculative.startswith(DRAFT):
        return None
    if not (name := speculative.removeprefix(DRAFT)):
        raise ValueError("speculative draft:<model> needs a model name, HF folder or GGUF file")
    return name


def proposer_named(name: str) -> Proposer:
    if name not in PROPOSERS:
        raise ValueError(
            f"speculative must be one of {', '.join(PROPOSERS)} or {DRAFT}<model>, got {name!r}"
        )
    return PROPOSERS[name]()


class SpeculativeChoices(list):
    """The option's values for a command line: the proposers' names, and `draft:` followed by
    any model (argparse checks a value with `in`, and lists the entries in its help)."""

    def __init__(self) -> None:
        super().__init__([*PROPOSERS, DRAFT + "MODEL"])

    def __contains__(self, value: object) -> bool:
        return value in PROPOSERS or (isinstance(value, str) and len(value) > len(DRAFT)
                                      and value.startswith(DRAFT))  # fmt: skip


__all__ = [
    "DRAFT", "PROPOSERS", "DraftProposer", "NgramProposer", "Proposer", "SpeculativeChoices",
    "SuffixProposer", "draft_model_name", "proposer_named", "scope_key",
]  # fmt: skip
