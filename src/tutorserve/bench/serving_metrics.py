"""Serving metrics from per-request traces: TTFT, TPOT, ITL, end-to-end latency, goodput.

Definitions follow vLLM's `benchmark_serving`: TTFT is send → first content; TPOT is the mean gap
per output token after the first, (e2e − TTFT) / (n − 1); ITL is every gap between streamed
chunks; goodput counts completed requests per second that met every SLO given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    session: int
    turn: int
    prompt_tokens: int
    start: float  # seconds on the benchmark clock
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None  # as the server reported it in usage, if it does
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        assert self.end is not None
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(slots=True)
class SLO:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and r.ttft * 1000 > self.ttft_ms:
            return False
        tpot = r.tpot
        return self.tpot_ms is None or tpot is None or tpot * 1000 <= self.tpot_ms


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(name: str, values: list[float], scale: float) -> dict[str, float]:
    mean = sum(values) / len(values) if values else math.nan
    out = {f"mean_{name}": mean * scale}
    for q in (50, 90, 99):
        out[f"p{q}_{name}"] = percentile(values, q) * scale
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict[str, float]:
    """Aggregate metrics over a run of `duration_s` seconds (first send to last reply)."""
    done = [r for r in records if r.ok]
    out: dict[str, float] = {
        "completed": len(done),
        "errors": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration_s,
        "output_throughput": sum(r.output_tokens for r in done) / duration_s,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "goodput": sum(slo.met(r) for r in done) / duration_s,
        "slo_attainment": sum(slo.met(r) for r in done) / len(records) if records else math.nan,
    }
    out |= _stats("ttft_ms", [r.ttft for r in done], 1000)
    out |= _stats("tpot_ms", [t for r in done if (t := r.tpot) is not None], 1000)
    out |= _stats("itl_ms", [x for r in done for x in r.itls], 1000)
    out |= _stats("e2e_ms", [r.e2e for r in done], 1000)
    reported = [r for r in done if r.cached_tokens is not None]
    if reported:
        prompt = sum(r.prompt_tokens for r in reported)
        out["usage_cached_token_rate"] = sum(r.cached_tokens or 0 for r in reported) / prompt
        if (history := history_cached_rate(reported)) is not None:
            out["history_cached_token_rate"] = history
    return out


def history_cached_rate(records: list[RequestRecord]) -> float | None:
    """Of the tokens each later turn carries over from its session's previous turn (that turn's
    prompt and reply), the share the server reported as cached: what session routing is meant
    to keep. Engines count cached tokens in whole blocks, so a turn falls short of its whole
    history by up to a block even when all of it was kept. None without later turns."""
    by_turn = {(r.session, r.turn): r for r in records}
    carried = cached = 0
    for r in records:
        prev = by_turn.get((r.session, r.turn - 1))
        if r.turn == 0 or prev is None or r.cached_tokens is None:
            continue
        history = prev.prompt_tokens + prev.output_tokens
        carried += history
        cached += min(r.cached_tokens, history)
    return cached / carried if carried else None
