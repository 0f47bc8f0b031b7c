"""Incremental detokenization and stop-string detection.

Decoding only the last released token(s) plus the new one keeps per-token cost constant; text is
released only once it no longer ends in an incomplete UTF-8 sequence (the replacement character).
"""

from __future__ import annotations

from tutorserve.models.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly complete text (possibly empty)."""
        self.ids.append(token_id)
        dec = self.tokenizer.decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = dec(self.ids[self.prefix_offset :], self.skip_special)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix) :]
        self.text += new
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new


def find_stop(text: str, new_len: int, stops: list[str]) -> int:
    """Index where the earliest stop string starts in `text`, searching only where the last
    `new_len` characters could complete one; -1 when none."""
    if not stops or not new_len:
        return -1
    best = -1
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best == -1 or idx < best):
            best = idx
    return best
