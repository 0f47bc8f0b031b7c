"""Engine configuration: one slotted dataclass; the LLM facade filters **kwargs through it.

Each option is declared once, here: its default, its check, and how it appears on the command
line (`Flag` in the field's metadata), from which `add_engine_args` builds the CLI's arguments
for `serve`, `generate`, `chat` and the benchmarks, and `engine_options` reads them back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
QUANTIZATIONS = ("auto", "none", "int8", "int4")
GIB = 2**30
_SAME = object()


@dataclass(frozen=True, slots=True)
class Flag:
    """How an option appears on the command line (default flag: --field-name)."""

    help: str
    group: str = "engine"
    flag: str | None = None
    type: Callable[[str], Any] | None = None  # default: the type of the option's default
    scale: int = 1  # option value = CLI value × scale (GiB on the CLI, bytes here)
    choices: tuple[str, ...] | None = None
    cli_default: Any = _SAME  # the CLI's default, where it differs from the API's (a callable
    # is called when the parser is built: an environment variable, say)
    negate: bool = False  # a boolean given as --no-FLAG, which turns it off
    parse: Callable[[list[str]], Any] | None = None  # a repeatable flag's values → the option
    metavar: str | None = None


def _option(default: Any, flag: Flag) -> Any:
    return dataclasses.field(default=default, metadata={"cli": flag})


def _lora_modules(specs: list[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora takes NAME=PATH, got {spec!r}")
        if name in out:
            raise ValueError(f"--lora {name} is given twice")
        out[name] = path
    return out


_TIERS, _LORA = "KV tiers (0 turns a tier off)", "LoRA adapters"
_SPEC = "speculative decoding"


@dataclass(slots=True)
class EngineConfig:
    model: str = _option(
        "smollm2-135m-instruct", Flag("registered name, HF dir or .gguf file", type=str)
    )
    dtype: str = _option("auto", Flag("the model's dtype (auto: see README)", choices=DTYPES))
    kv_cache_dtype: str = _option(
        "auto",
        Flag("KV storage dtype (auto: the model's; on a CPU without native bf16, bf16 storage)",
             choices=DTYPES),
    )  # fmt: skip
    device: str = _option("auto", Flag("where the model runs", choices=DEVICES))
    # auto by default: on the default model the blocks win at every batch measured, and its
    # serving goodput on `random` rose 0.53 -> 0.76 req/s (docs/benchmarks/quantization.md).
    quantization: str = _option(
        "auto",
        Flag("weights: auto keeps a GGUF's or an AWQ/GPTQ checkpoint's quantized blocks (on a "
             "CPU), none dequantizes them, int8/int4 quantize a HF checkpoint at load",
             choices=QUANTIZATIONS),
    )  # fmt: skip
    block_size: int = _option(16, Flag("tokens per KV block (a power of two)"))
    # KV budget: an explicit block count wins over a byte budget.
    num_kv_blocks: int | None = _option(None, Flag("KV budget in blocks", type=int))
    kv_cache_bytes: int = _option(
        1 * GIB, Flag("KV budget in GiB", flag="--kv-cache-gb", type=float, scale=GIB)
    )
    max_model_len: int | None = _option(None, Flag("longest prompt + output", type=int))
    max_num_seqs: int = _option(64, Flag("requests in the running batch"))
    max_num_batched_tokens: int = _option(2048, Flag("tokens computed per step"))
    enable_prefix_caching: bool = _option(
        True, Flag("reuse cached prompt blocks", flag="--prefix-caching", negate=True)
    )
    # Admission order within a priority, by policy name (engine/policy.py: "cache-aware",
    # "fcfs"), which the scheduler checks.
    scheduling: str = _option("cache-aware", Flag("admission order within a priority"))
    max_bypass: int = 32  # times a request may be passed over by a later arrival
    seed: int = _option(0, Flag("sampling seed for requests without one"))
    # vLLM's VLLM_BATCH_INVARIANT, SGLang's --enable-deterministic-inference: bf16 sums that
    # PyTorch's GEMMs order by the batch's shape, and cascade attention's merge, otherwise make
    # a row's tokens depend on its neighbours (docs/benchmarks/speculative.md).
    batch_invariant: bool = _option(
        False,
        Flag("give a request the same tokens whatever else the batch holds (every matmul on "
             "quantized blocks, no cascade attention; slower prefill and large batches)"),
    )  # fmt: skip
    num_threads: int | None = _option(None, Flag("CPU threads (default: PyTorch's)", type=int))
    # For calibrating the simulator on the steps an engine runs in a server (bench/calibrate.py).
    step_log_dir: str | None = _option(
        None, Flag("write every step's shape and time to DIR/steps-<pid>-<n>.jsonl", type=str,
                   metavar="DIR"),
    )  # fmt: skip
    # KV tiers below the pool (0 turns a tier off). The disk tier outlives the process; the
    # offline API leaves it off by default, the CLI turns it on.
    kv_ram_bytes: int = _option(
        2 * GIB,
        Flag("host-RAM tier budget in GiB", _TIERS, "--kv-ram-gb", float, GIB),
    )
    kv_disk_bytes: int = _option(
        0, Flag("disk tier budget in GiB", _TIERS, "--kv-disk-gb", float, GIB, cli_default=4.0)
    )
    kv_disk_dir: str = _option(
        "~/.cache/tutorserve/kv",
        Flag("disk tier folder, kept across restarts (env TUTORSERVE_KV_DIR)", _TIERS,
             cli_default=lambda: os.environ.get("TUTORSERVE_KV_DIR", "~/.cache/tutorserve/kv")),
    )  # fmt: skip
    session_ttl: float = _option(
        3600.0, Flag("seconds a session's KV is kept ahead of other cached KV", _TIERS)
    )
    # Replicas sharing the disk folder turn this on (cluster/replica.py): a session's blocks
    # reach disk when its turn ends, not when the engine next idles, so another replica can
    # resume the session if this one dies. A busy engine pays for it in disk-writer GIL time.
    session_write_through: bool = _option(
        False, Flag("write a session's KV to the disk tier as each turn ends", _TIERS)
    )
    # Multi-LoRA: adapters by name → PEFT folder, loaded at start; more can be loaded later.
    enable_lora: bool = _option(False, Flag("serve PEFT LoRA adapters", _LORA))
    lora_modules: dict[str, str] = dataclasses.field(
        default_factory=dict,
        metadata={"cli": Flag("an adapter to load at start (repeatable; implies --enable-lora)",
                              _LORA, flag="--lora", parse=_lora_modules, metavar="NAME=PATH")},
    )  # fmt: skip
    max_loras: int = _option(8, Flag("adapters in compute slots (usable in one step)", _LORA))
    max_lora_rank: int = _option(16, Flag("largest adapter rank", _LORA))
    max_cpu_loras: int = _option(64, Flag("adapters kept in host RAM", _LORA))
    # Speculative decoding: a proposer by name (spec/: "ngram", "suffix", or "draft:<model>" for
    # a draft model with the target's tokenizer), None for off.
    speculative: str | None = _option(
        None, Flag("draft tokens with this proposer and verify them in one step", _SPEC, type=str)
    )
    # The most drafts a row gets; None: the proposer's own (11 for suffix, whose drafts are as
    # long as its match makes likely to be kept; 4 for the others).
    num_speculative_tokens: int | None = _option(
        None, Flag("most tokens drafted per decode row (default: the proposer's)", _SPEC, type=int)
    )
    # Above this many requests in a step, verifying drafts costs more than it saves, so nobody
    # speculates (vLLM's name). The measured policy times decode-only steps alone; 16 gained
    # nothing on tutor turns (docs/benchmarks/speculative.md).
    speculative_disable_by_batch_size: int = _option(
        8, Flag("requests in a step above which speculation pauses", _SPEC)
    )
    # Below that ceiling, by policy name (spec/backoff.py: "fixed" drafts always, "measured"
    # while a drafted token's share kept times a plain step's cost per row exceeds its own
    # cost, each as measured).
    speculative_backoff: str = _option(
        "measured", Flag("when to draft below that ceiling: fixed or measured", _SPEC)
    )

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(unknown)}")
        cfg = cls(**kwargs)  # type: ignore[arg-type]
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError("num_kv_blocks must be positive")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.kv_ram_bytes < 0 or self.kv_disk_bytes < 0:
            raise ValueError("kv_ram_bytes and kv_disk_bytes must be >= 0 (0 turns a tier off)")
        if self.lora_modules and not self.enable_lora:
            self.enable_lora = True
        if self.max_loras < 1 or self.max_cpu_loras < self.max_loras:
            raise ValueError("max_loras must be >= 1 and max_cpu_loras >= max_loras")
        if not 1 <= self.max_lora_rank <= 256:
            raise ValueError("max_lora_rank must be in 1..256")
        if self.batch_invariant and self.enable_lora:
            raise ValueError("batch_invariant does not cover LoRA adapters (their low-rank "
                             "matmuls are PyTorch's): turn one of them off")  # fmt: skip
        if self.kv_disk_bytes and not self.kv_disk_dir:
            raise ValueError("kv_disk_dir is required when the disk tier is on")
        if self.session_ttl <= 0:
            raise ValueError("session_ttl must be positive")
        if self.max_bypass < 0:
            raise ValueError("max_bypass must be >= 0")
        drafts = 1 if self.num_speculative_tokens is None else self.num_speculative_tokens
        if drafts < 1 or self.speculative_disable_by_batch_size < 1:
            raise ValueError(
                "num_speculative_tokens and speculative_disable_by_batch_size must be >= 1"
            )
        for name, allowed in (
            ("dtype", DTYPES), ("kv_cache_dtype", DTYPES), ("device", DEVICES),
            ("quantization", QUANTIZATIONS),
        ):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}"
                )


def add_engine_args(
    parser: argparse.ArgumentParser,
    only: Iterable[str] | None = None,
    choices: dict[str, Iterable[str]] | None = None,
) -> None:
    """The declared options (or `only` these) as flags of `parser`, in their groups; the parser
    remembers which, for `engine_options`. `choices` adds what only a higher layer knows (the
    scheduling policies' names, say), so a wrong value fails before the model loads."""
    groups: dict[str, Any] = {}
    added = []
    for f in dataclasses.fields(EngineConfig):
        cli: Flag | None = f.metadata.get("cli")
        if cli is None or (only is not None and f.name not in only):
            continue
        added.append(f.name)
        if cli.group not in groups:
            groups[cli.group] = parser.add_argument_group(cli.group)
        group, flag = groups[cli.group], cli.flag or "--" + f.name.replace("_", "-")
        if cli.negate:
            flag = "--no-" + flag.removeprefix("--")
            group.add_argument(flag, dest=f.name, action="store_false", help=f"don't {cli.help}")
        elif cli.parse is not None:
            group.add_argument(flag, dest=f.name, action="append", default=[],
                               metavar=cli.metavar, help=cli.help)  # fmt: skip
        elif isinstance(f.default, bool):
            group.add_argument(flag, dest=f.name, action="store_true", help=cli.help)
        else:
            default = f.default if cli.scale == 1 else f.default / cli.scale
            default = default if cli.cli_default is _SAME else cli.cli_default
            allowed = cli.choices or (choices or {}).get(f.name)
            group.add_argument(
                flag, dest=f.name, type=cli.type or type(f.default), choices=allowed,
                default=default() if callable(default) else default, help=cli.help,
                metavar=cli.metavar or (None if allowed else flag[2:].replace("-", "_").upper()),
            )  # fmt: skip
    parser.set_defaults(engine_fields=tuple(added))


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options `add_engine_args` gave the parser, read from `args` as `EngineConfig`
    keyword arguments."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    out = {}
    for name in getattr(args, "engine_fields", ()):
        cli: Flag = fields[name].metadata["cli"]
        value = getattr(args, name)
        if cli.parse is not None:
            value = cli.parse(value)
        elif cli.scale != 1:
            value = int(value * cli.scale)
        out[name] = value
    return out
