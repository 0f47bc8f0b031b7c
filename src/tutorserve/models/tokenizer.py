"""Tokenizer: a `tokenizers` fast tokenizer plus the special ids and chat template we need."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as FastTokenizer
from tokenizers import decoders


class Tokenizer:
    def __init__(
        self,
        tokenizer: FastTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: list[int],
        chat_template: str | None,
        add_bos_token: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def backend(self) -> FastTokenizer:
        """The `tokenizers` tokenizer itself (grammar engines read its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes (a piece of a multi-byte character is not valid UTF-8 alone,
        so decoding it by itself would give U+FFFD)."""
        piece = self._tok.id_to_token(token_id) or ""
        if isinstance(self._tok.decoder, decoders.ByteLevel) and all(c in _BYTE_OF for c in piece):
            return bytes(_BYTE_OF[c] for c in piece)
        return piece.encode()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent)
            self._template = env.from_string(self.chat_template)
        tok = self._tok
        return self._template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else "",
            eos_token=tok.id_to_token(self.eos_token_id) if self.eos_token_id is not None else "",
        )

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """Token ids of the conversation, by default ready for the assistant's turn. The template
        already holds BOS where the model wants one."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        return self.encode(text, add_special_tokens)

    def token_strs(self, ids: list[int]) -> list[str]:
        """The vocabulary's entries for these ids, as the tokenizer stores them (byte-level BPE
        pieces, not decoded text)."""
        return [self._tok.id_to_token(i) for i in ids]

    @classmethod
    def from_hf_dir(cls, path: Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        fast = FastTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return fast.token_to_id(tok) if tok else None

        eos = eos_token_ids or ([e] if (e := token_id("eos_token")) is not None else [])
        template = cfg.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.exists():
            template = template_file.read_text()
        return cls(
            fast,
            bos_token_id=token_id("bos_token"),
            eos_token_ids=eos,
            chat_template=template,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
        )


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes byte b as one printable character: itself if printable,
    else chr(256 + k) for the k-th unprintable byte. Returns that character → b."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = (b for b in range(256) if b not in printable)
    chars = {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(extra)}
    return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_level_alphabet()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
