"""`tutorserve bench spec`: decode speed with each speculative proposer against none, on tutor
replies. The prompts are the explain agent's own (`tutor/prompts.py`): for every problem of the
built-in courses, a known wrong answer and the hint, guiding-question and worked-correction
tasks, as a first turn of a session. Greedy, in process; at concurrency C the engine keeps C
requests in flight, adding the next as one ends. Per run: mean TPOT (time after the first token
over the tokens after it), output throughput, and the share of drafted tokens accepted; and
whether every method produced the same tokens (greedy speculation must).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tutorserve.config import EngineConfig
from tutorserve.engine.engine import LLMEngine
from tutorserve.engine.outputs import RequestOutput
from tutorserve.sampling_params import SamplingParams
from tutorserve.tutor.courses import load_courses
from tutorserve.tutor.prompts import explain_messages


@dataclass(slots=True)
class SpecResult:
    method: str  # "none" or a proposer's name
    concurrency: int
    requests: int
    output_tokens: int
    mean_tpot_ms: float
    throughput_tok_s: float
    drafted: int
    accepted: int


def tutor_prompts() -> list[list[dict[str, str]]]:
    """Chat messages of the explain step for each problem and rung 1-3 of the ladder."""
    out = []
    for course in load_courses().values():
        for problem in course.problems:
            wrong = problem.misconceptions[0].answer if problem.misconceptions else "41"
            diagnosis = problem.misconceptions[0].diagnosis if problem.misconceptions else ""
            for level in (1, 2, 3):
                out.append(explain_messages(course, problem, wrong, [], level, diagnosis, []))
    return out


def _serve(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int,
           bar: tqdm) -> tuple[list[RequestOutput], float]:  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    todo, inflight, done = list(enumerate(prompts)), 0, []
    start = time.perf_counter()
    while todo or engine.has_unfinished():
        while todo and inflight < concurrency:
            i, ids = todo.pop(0)
            engine.add_request(f"r{i}", ids, params)
            inflight += 1
        for out in engine.step():
            if out.finished:
                done.append(out)
                inflight -= 1
                bar.update()
    return sorted(done, key=lambda o: int(o.request_id[1:])), time.perf_counter() - start


def run_spec_bench(
    model: str,
    methods: list[str],
    concurrencies: list[int],
    num_prompts: int,
    max_tokens: int,
    options: dict[str, Any],
) -> tuple[list[SpecResult], bool]:
    """Results per (method, concurrency), and whether all methods' tokens were identical."""
    results, tokens = [], {}
    total = len(methods) * len(concurrencies) * num_prompts
    with tqdm(total=total, desc="spec bench", unit="req") as bar:
        for method in methods:
            spec = {} if method == "none" else {"speculative": method}
            engine = LLMEngine(EngineConfig.from_kwargs(model=model, **options, **spec))
            prompts = [engine.tokenizer.encode_chat(m) for m in tutor_prompts()[:num_prompts]]
            for c in concurrencies:
                before = engine.stats().spec
                outs, wall = _serve(engine, prompts, c, max_tokens, bar)
                after = engine.stats().spec
                tokens[(method, c)] = [o.token_ids for o in outs]
                tpots = [
                    (o.metrics.finish_time - o.metrics.first_token_time)
                    / (o.metrics.num_output_tokens - 1)
                    for o in outs
                    if o.metrics.num_output_tokens > 1
                ]
                results.append(
                    SpecResult(
                        method, c, len(outs), sum(o.metrics.num_output_tokens for o in outs),
                        1000 * sum(tpots) / max(1, len(tpots)),
                        sum(o.metrics.num_output_tokens for o in outs) / wall,
                        after.num_draft_tokens - before.num_draft_tokens,
                        after.num_accepted_tokens - before.num_accepted_tokens,
                    )
                )  # fmt: skip
            engine.close()
    identical = all(
        tokens[(m, c)] == tokens[(methods[0], c)] for m in methods for c in concurrencies
    )
    return results, identical


def table(results: list[SpecResult]) -> str:
    base = {r.concurrency: r for r in results if r.method == "none"}
    lines = [
        "| method | concurrency | mean TPOT ms | TPOT vs none | output tok/s "
        "| accepted / drafted |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ref = base.get(r.concurrency)
        gain = f"{ref.mean_tpot_ms / r.mean_tpot_ms:.2f}× lower" if ref and r is not ref else "–"
        rate = f"{r.accepted}/{r.drafted} ({r.accepted / r.drafted:.0%})" if r.drafted else "–"
        lines.append(
            f"| {r.method} | {r.concurrency} | {r.mean_tpot_ms:.1f} | {gain} "
            f"| {r.throughput_tok_s:.1f} | {rate} |"
        )
    return "\n".join(lines)


def plot(results: list[SpecResult], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r.method for r in results))
    concurrencies = sorted({r.concurrency for r in results})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        ys = [next(r.mean_tpot_ms for r in results if (r.method, r.concurrency) == (method, c))
              for c in concurrencies]  # fmt: skip
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(concurrencies))]
        ax.bar(xs, ys, width, label=method)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.1f}", (x, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(concurrencies)), [f"{c} in flight" for c in concurrencies])
    ax.set_ylabel("mean TPOT, ms (lower is better)")
    ax.set_title("Tutor replies: speculative decoding against none")
    ax.legend(title="proposer")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def as_json(results: list[SpecResult], identical: bool) -> dict:
    return {"identical_outputs": identical, "results": [asdict(r) for r in results]}
