"""`tutorserve bench structured`: what constrained decoding costs a server. Each system serves
the model in turn; `batch` students at once ask for a diagnosis of their answer through
`/v1/chat/completions`, streamed, greedy, once free and once with `response_format` set to a JSON
schema (a diagnosis), alternating over repeats. Per request, TPOT: the time from its first
content chunk to its last over the tokens after the first; per run, the median; per (system,
batch), the overhead of the schema: constrained TPOT over free TPOT. Free replies ignore EOS and
run to max_tokens; the JSON ones end when the object closes, which this small model rarely does
before max_tokens (the table gives both lengths, and how many replies were whole JSON), so both
runs keep their batch full to the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from tutorserve.bench.registry import make_system
from tutorserve.bench.systems import ModelFiles, RunningServer, ServeSpec

log = logging.getLogger(__name__)

SCHEMA = {
    "type": "object",
    "properties": {
        "correct": {"type": "boolean"},
        "misconception": {"type": "string"},
        "hint": {"type": "string"},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["correct", "misconception", "hint", "confidence"],
    "additionalProperties": False,
}
_FORMAT = {"type": "json_schema", "json_schema": {"name": "diagnosis", "schema": SCHEMA}}


@dataclass(slots=True)
class StructuredResult:
    system: str
    batch: int
    constrained: bool
    repeat: int
    median_tpot_ms: float
    mean_output_tokens: float
    valid_json: int  # replies that parse and have every required key
    requests: int


def _messages(i: int) -> list[dict[str, str]]:
    a, b = 3 + i % 7, 2 + i % 5  # the answer is 4; the student says 5, 6 or 7
    wrong = 5 + i % 3
    return [
        {"role": "system", "content": "You are a maths tutor. Diagnose the student's answer as "
         "JSON with keys correct, misconception, hint and confidence (0-10)."},
        {"role": "user", "content": f"Problem: solve {a}x + {b} = {a * 4 + b}. "
         f"Student {i} answered x = {wrong}."},
    ]  # fmt: skip


async def _one(client: httpx.AsyncClient, model: str, i: int, constrained: bool,
               max_tokens: int) -> tuple[float | None, int, bool]:  # fmt: skip
    body = {
        "model": model,
        "messages": _messages(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = _FORMAT
    else:  # to max_tokens, as the JSON replies mostly run: the batch keeps its size
        body["ignore_eos"] = True
    stamps, text, tokens = [], [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
            for c in data.get("choices", []):
                if c["delta"].get("content"):
                    stamps.append(time.perf_counter())
                    text.append(c["delta"]["content"])
    tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 and len(stamps) > 1 else None
    return tpot, tokens, _valid("".join(text))


def _valid(text: str) -> bool:
    try:
        reply = json.loads(text)
    except ValueError:
        return False
    return isinstance(reply, dict) and set(SCHEMA["required"]) <= set(reply)


async def _run(url: str, model: str, batch: int, constrained: bool, max_tokens: int, first: int
               ) -> list[tuple[float | None, int, bool]]:  # fmt: skip
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        return await asyncio.gather(
            *(_one(client, model, first + i, constrained, max_tokens) for i in range(batch))
        )


def run_structured_bench(systems: list[str], files: ModelFiles, batches: list[int], repeats: int,
                         max_tokens: int, out: Path, port: int = 8500, dtype: str = "auto"
                         ) -> list[StructuredResult]:  # fmt: skip
    results = []
    runs = len(batches) * repeats * 2
    for name in systems:
        spec = ServeSpec(files, port, max(batches), 1.0, dtype)
        system = make_system(name, spec)
        if system.missing:
            log.warning("skipping %s: not installed (%s)", name, system.missing)
            continue
        with RunningServer(system, port, out / "logs" / f"{name}.log") as server:
            for constrained in (False, True):  # warm-up: compile caches, first-call costs
                asyncio.run(_run(server.url, files.name, 2, constrained, 8, 10_000))
            bar = tqdm(total=runs, desc=name, unit="run")
            for batch in batches:
                for repeat in range(repeats):
                    for constrained in (False, True) if repeat % 2 == 0 else (True, False):
                        got = asyncio.run(_run(server.url, files.name, batch, constrained,
                                               max_tokens, repeat * batch))  # fmt: skip
                        tpots = [t for t, _, _ in got if t is not None]
                        results.append(StructuredResult(
                            name, batch, constrained, repeat,
                            1000 * statistics.median(tpots) if tpots else float("nan"),
                            statistics.mean(n for _, n, _ in got), sum(v for *_, v in got),
                            len(got),
                        ))  # fmt: skip
                        bar.update()
            bar.close()
    return results


def table(results: list[StructuredResult]) -> str:
    """Per system and batch: free and constrained TPOT (median over repeats of run medians),
    reply lengths, valid JSON replies, and the overhead."""
    lines = [
        "| system | batch | TPOT free (ms) | TPOT JSON schema (ms) | overhead | tokens free / "
        "JSON | valid JSON free / schema |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    keys = dict.fromkeys((r.system, r.batch) for r in results)
    for system, batch in keys:
        rows = {c: [r for r in results if (r.system, r.batch, r.constrained) == (system, batch, c)]
                for c in (False, True)}  # fmt: skip
        tpot = {c: statistics.median(r.median_tpot_ms for r in rows[c]) for c in rows}
        toks = {c: statistics.mean(r.mean_output_tokens for r in rows[c]) for c in rows}
        valid = {c: f"{sum(r.valid_json for r in rows[c])}/{sum(r.requests for r in rows[c])}"
                 for c in rows}  # fmt: skip
        lines.append(
            f"| {system} | {batch} | {tpot[False]:.1f} | {tpot[True]:.1f} | "
            f"{tpot[True] / tpot[False] - 1:+.1%} | {toks[False]:.0f} / {toks[True]:.0f} | "
            f"{valid[False]} / {valid[True]} |"
        )
    return "\n".join(lines)


def as_json(results: list[StructuredResult]) -> list[dict]:
    return [asdict(r) for r in results]


def plot(results: list[StructuredResult], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.system, r.batch) for r in results))
    fig, ax = plt.subplots(figsize=(1.6 * len(keys) + 2, 3.5))
    for k, (system, batch) in enumerate(keys):
        for c, colour in ((False, "tab:blue"), (True, "tab:orange")):
            vals = [r.median_tpot_ms for r in results
                    if (r.system, r.batch, r.constrained) == (system, batch, c)]  # fmt: skip
            ax.bar(k + (0.2 if c else -0.2), statistics.median(vals), 0.4, color=colour,
                   label=("JSON schema" if c else "free") if k == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(keys)), [f"{s}\nbatch {b}" for s, b in keys])
    ax.set_ylabel("median TPOT (ms)")
    ax.set_title("Structured-output overhead")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
