"""`tutorserve bench spec`: decode speed with each speculative proposer against none, on a class
of students getting tutor replies. The prompts are the explain agent's own (`tutor/prompts.py`):
problem by problem of the built-in courses, rung by rung of the ladder (hint, guiding question,
worked correction), `students` students each send one of the problem's known wrong answers, as
the first turn of their session; so, as in a class, several students get the reply to the same
mistake. Greedy, in process; at concurrency C the engine keeps C requests in flight, adding the
next as one ends. Per run: mean TPOT (time after the first token over the tokens after it),
output throughput and the share of drafted tokens accepted; and how many replies equal those of
the first method (greedy speculation gives the same tokens up to the rounding of a different
batch shape: exact in float32, near-ties may flip in bf16).
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
from tutorserve.tutor.courses import Misconception, load_courses
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


def tutor_prompts(students: int) -> list[list[dict[str, str]]]:
    """Chat messages of the explain step: problems in course order, rungs 1-3, then students."""
    out = []
    for course in load_courses().values():
        for problem in course.problems:
            wrong = problem.misconceptions or [Misconception(answer="41", diagnosis="")]
            for level in (1, 2, 3):
                for s in range(students):
                    m = wrong[s % len(wrong)]
                    out.append(
                        explain_messages(course, problem, m.answer, [], level, m.diagnosis, [])
                    )
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
    students: int,
    num_prompts: int,
    max_tokens: int,
    options: dict[str, Any],
) -> tuple[list[SpecResult], dict[str, int]]:
    """Results per (method, concurrency), and per method the replies (over all concurrencies)
    equal to the first method's."""
    results, tokens = [], {}
    total = len(methods) * len(concurrencies) * num_prompts
    with tqdm(total=total, desc="spec bench", unit="req") as bar:
        for method in methods:
            spec = {} if method == "none" else {"speculative": method}
            engine = LLMEngine(EngineConfig.from_kwargs(model=model, **options, **spec))
            prompts = [
                engine.tokenizer.encode_chat(m) for m in tutor_prompts(students)[:num_prompts]
            ]
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
    same = {
        m: sum(
            a == b
            for c in concurrencies
            for a, b in zip(tokens[(m, c)], tokens[(methods[0], c)], strict=True)
        )
        for m in methods
    }
    return results, same


def table(results: list[SpecResult]) -> str:
    base = {r.concurrency: r for r in results if r.method == "none"}
    lines = [
        "| method | concurrency | mean TPOT ms | TPOT vs none | output tok/s "
        "| accepted / drafted |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        ref = base.get(r.concurrency)
        gain = "–"
        if ref and r is not ref:
            x = ref.mean_tpot_ms / r.mean_tpot_ms
            gain = f"{x:.2f}× lower" if x >= 1 else f"{1 / x:.2f}× higher"
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


def as_json(results: list[SpecResult], same: dict[str, int]) -> dict:
    return {"replies_equal_to_first_method": same, "results": [asdict(r) for r in results]}
