"""The offline API: `LLM(model=...).generate(prompts, params)` and `.chat(messages)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm import tqdm

from tutorserve.config import EngineConfig
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.models.registry import DEFAULT_MODEL
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sampling_params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_options))
        self._ids = itertools.count()

    def load_lora(self, name: str, path: str) -> None:
        """Register a PEFT LoRA adapter folder under `name`, for `generate(..., lora=name)`."""
        self.engine.load_lora(name, path)

    def close(self) -> None:
        """Finish pending KV-tier disk writes. Also happens at interpreter exit."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        session_id: str | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. With a
        `session_id`, each finished request's KV is written through to the KV tiers, so the
        session's next turn (even in a new process, with a disk tier) prefills only what is new.
        `lora` names a loaded adapter for every prompt, or gives one name (or None: the base
        model) per prompt; requests of different adapters share each step's batch."""
        batch = _as_prompt_list(prompts)
        plist = _as_params_list(params, len(batch))
        ids = self._add_all(batch, plist, session_id, lora)
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        if not self.engine.has_unfinished():
            self.engine.on_idle()
        return [done[i] for i in ids]

    def chat(
        self,
        messages: list[Message] | Sequence[list[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several; each ends in an assistant turn."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.render_chat(c) for c in convs]
        return self.generate(prompts, params, **kwargs)

    def render_chat(self, messages: list[Message]) -> str:
        if not messages:
            raise ValueError("messages is empty")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, lora: str | None = None
    ) -> Iterator[str]:
        """Yield text pieces of one request as they are generated."""
        (rid,) = self._add_all([prompt], [params or SamplingParams()], lora=lora)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        if out.delta_text:
                            yield out.delta_text
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

    def _add_all(
        self,
        prompts: list[Prompt],
        params: list[SamplingParams],
        session_id: str | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[str]:
        # Validate the whole batch before queueing any of it, so a bad prompt leaves no work.
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} LoRA names for {len(prompts)} prompts")
        for name in set(loras):
            self.engine.check_lora(name)
        for p, sp in zip(prompts, params, strict=True):
            sp.validate()
            if not isinstance(p, str):
                self.engine.check_prompt(p)
        ids = []
        try:
            for p, sp, name in zip(prompts, params, loras, strict=True):
                rid = f"offline-{next(self._ids)}"
                self.engine.add_request(rid, p, sp, session_id=session_id, lora=name)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # type: ignore[list-item]
    for p in prompts:
        if not isinstance(p, str | list) or (
            isinstance(p, list) and not all(isinstance(t, int) for t in p)
        ):
            raise ValueError("each prompt must be a string or a list of token ids")
    return prompts  # type: ignore[return-value]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    plist = list(params)
    if len(plist) != n:
        raise ValueError(f"{len(plist)} sampling params for {n} prompts")
    return plist
