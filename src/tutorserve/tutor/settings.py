"""The tutor's deployment settings, from one YAML file (`serve --tutor-config`): which model
writes each tier, the tiering policy, the reply cache, the breakers, hedging and the per-school
quotas. The file is checked as a whole before any model loads. Each section is validated
straight into the object that uses it (`BreakerConfig`, `HedgeConfig`, `Limits`, the policy,
`EngineConfig`), so no option is declared a second time here. docs/tutor-config.md describes
the file; an example:

    policy: learner-state
    models:
      small: {served: true}                    # this server's own engine
      large: {path: /models/qwen2.5-0.5b.gguf, engine: {dtype: bfloat16}}
    reply_cache: {max_entries: 50000}
    breaker: {slow_s: 10}
    hedge: {after_s: 4}
    quotas:
      default: {turns_per_minute: 30, over: degrade, degrade_to: small}
      schools: {north: {turns_per_day: 5000, priority: -1}}
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from tutorserve.config import EngineConfig
from tutorserve.engine.async_engine import AsyncEngine
from tutorserve.engine.engine import LLMEngine
from tutorserve.tutor.breaker import BreakerConfig
from tutorserve.tutor.hedge import HedgeConfig
from tutorserve.tutor.llm_client import ChatLLM, EngineLLM, OpenAILLM
from tutorserve.tutor.quotas import Limits, Quotas
from tutorserve.tutor.reply_cache import ReplyCache
from tutorserve.tutor.routing import Routing
from tutorserve.tutor.tiers import POLICIES, Tier, TieringPolicy

_STRICT = ConfigDict(extra="forbid")


class ModelSpec(BaseModel):
    """Where one tier's model runs: exactly one of `served`, `path` or `url`."""

    model_config = _STRICT
    served: bool = False  # this server's own engine
    adapter: str | None = None  # with `served`: one of the server's `--lora` adapters
    path: str | None = None  # a second engine in this process, on this model
    engine: dict[str, Any] = Field(default_factory=dict)  # its `EngineConfig` options
    url: str | None = None  # an OpenAI-compatible endpoint (…/v1)
    model: str | None = None  # the model's name at `url`
    # The environment variable that holds `url`'s API key: keys stay out of the file.
    api_key_env: str | None = None
    _api_key: str | None = PrivateAttr(None)  # `--tutor-llm-key`, never read from the file

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [n for n in ("served", "path", "url") if getattr(self, n)]
        if len(sources) != 1:
            raise ValueError("a model is exactly one of served: true, path: ..., url: ...")
        stray = {
            "adapter": self.adapter is not None and not self.served,
            "engine": bool(self.engine) and self.path is None,
            "model/api_key_env": (self.model or self.api_key_env) is not None and not self.url,
        }
        if wrong := [k for k, bad in stray.items() if bad]:
            raise ValueError(f"{', '.join(wrong)} do not go with {sources[0]}")
        if self.path is not None:
            EngineConfig.from_kwargs(model=self.path, **self.engine)  # unknown options, now
        return self


class ReplyCacheSpec(BaseModel):
    model_config = _STRICT
    max_entries: int = 50_000


class QuotaSpec(BaseModel):
    """`default`: the limits of a school not named in `schools` (none: unlimited)."""

    model_config = _STRICT
    default: Limits | None = None
    schools: dict[str, Limits] = Field(default_factory=dict)


class TutorSettings(BaseModel):
    """A file's settings; `plain()` is the tutor without one. A file that names no policy gets
    `learner-state`, the justified default (tiers.LearnerState)."""

    model_config = _STRICT
    policy: str = "learner-state"
    policy_options: dict[str, Any] = Field(default_factory=dict)
    models: dict[Tier, ModelSpec] = Field(
        default_factory=lambda: {Tier.LARGE: ModelSpec(served=True)}
    )
    reply_cache: ReplyCacheSpec | None = None  # absent: off
    breaker: BreakerConfig = BreakerConfig()
    hedge: HedgeConfig | None = HedgeConfig()  # null: a late model is not hedged
    quotas: QuotaSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> TutorSettings:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        self.tiering()  # its options, now
        if not self.models or Tier.AUTHORED in self.models:
            raise ValueError("models names a model for small, large or both (authored is text)")
        return self

    @classmethod
    def load(cls, path: str | Path) -> TutorSettings:
        """The settings in a YAML file; ValueError naming the file and the field when wrong."""
        try:
            raw = yaml.safe_load(Path(path).read_text("utf-8")) or {}
            return cls.model_validate(raw)
        except ValidationError as e:
            where = (".".join(map(str, err["loc"])) or "file" for err in e.errors())
            why = "; ".join(f"{w}: {err['msg']}" for w, err in zip(where, e.errors(), strict=True))
            raise ValueError(f"tutor config {path}: {why}") from e
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"tutor config {path}: {e}") from e

    @classmethod
    def plain(cls) -> TutorSettings:
        """No file: this engine for every agent, no reply cache, no quotas (before tiering)."""
        return cls(policy="uniform")

    @classmethod
    def one_endpoint(cls, url: str, model: str | None, api_key: str | None) -> TutorSettings:
        """`serve --tutor-llm-url`: every agent on one OpenAI-compatible endpoint."""
        spec = ModelSpec(url=url, model=model)
        spec._api_key = api_key
        return cls(policy="uniform", models={Tier.LARGE: spec})

    def tiering(self) -> TieringPolicy:
        policy = POLICIES[self.policy]
        known = {f.name for f in dataclasses.fields(policy)} - {"name"}
        if unknown := sorted(set(self.policy_options) - known):
            raise ValueError(f"policy {self.policy} has no option(s) {', '.join(unknown)}")
        return TypeAdapter(policy).validate_python(self.policy_options)

    def second_engines(self) -> dict[str, AsyncEngine]:
        """The engines the tutor runs beside the server's, by model path (loaded here: call it
        before the server starts; each is started and stopped with the tutor service)."""
        engines: dict[str, AsyncEngine] = {}
        for spec in self.models.values():
            if spec.path is not None and spec.path not in engines:
                config = EngineConfig.from_kwargs(model=spec.path, **spec.engine)
                engines[spec.path] = AsyncEngine(lambda c=config: LLMEngine(c))
        return engines

    def routing(
        self, server: AsyncEngine, served_name: str, engines: dict[str, AsyncEngine]
    ) -> Routing:
        """The routing over the tiers' models: `server` is this server's engine (served as
        `served_name`), `engines` what `second_engines` loaded."""
        models: dict[Tier, ChatLLM] = {}
        for tier, spec in self.models.items():
            if spec.served:
                name = f"{served_name}:{spec.adapter}" if spec.adapter else served_name
                models[tier] = EngineLLM(server, name, spec.adapter)
            elif spec.path is not None:
                models[tier] = EngineLLM(engines[spec.path], Path(spec.path).stem)
            else:
                key = spec._api_key
                if spec.api_key_env and (key := os.environ.get(spec.api_key_env)) is None:
                    raise ValueError(f"tutor model at {spec.url}: ${spec.api_key_env} is not set")
                models[tier] = OpenAILLM(spec.url, spec.model or served_name, key)  # type: ignore[arg-type]
        cache = ReplyCache(self.reply_cache.max_entries) if self.reply_cache else None
        return Routing(models, self.tiering(), self.breaker, cache, self.hedge)

    def quota_book(self) -> Quotas | None:
        if self.quotas is None:
            return None
        return Quotas(self.quotas.schools, self.quotas.default)
