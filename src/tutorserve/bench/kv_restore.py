"""Cold restore: TTFT of a request whose long history is recomputed, restored from the RAM tier,
or restored from the disk tier after a restart (with the files out of the OS page cache).

Each measurement is one request: a history of L tokens (a student's earlier turns) plus a
32-token new question, one output token. Histories are random token ids drawn per repeat, so no
measurement hits a cache another one filled.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from tutorserve import LLM, SamplingParams

log = logging.getLogger(__name__)
QUESTION_TOKENS = 32
SOURCES = ("recompute", "ram", "disk")


@dataclass(slots=True)
class RestoreResult:
    model: str
    history_tokens: int
    ttft_s: dict[str, list[float]] = field(default_factory=dict)  # source → one per repeat
    cached_tokens: dict[str, list[int]] = field(default_factory=dict)

    def median(self, source: str) -> float:
        return statistics.median(self.ttft_s[source])

    def record(self, source: str, ttft: float, cached: int) -> None:
        self.ttft_s.setdefault(source, []).append(ttft)
        self.cached_tokens.setdefault(source, []).append(cached)


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _drop_page_cache(folder: Path) -> None:
    """Make the next reads come from the device: flush each file and tell the kernel its cached
    pages are no longer needed (works without root, unlike /proc/sys/vm/drop_caches)."""
    for path in folder.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_restore(
    model: str, lengths: list[int], repeats: int, engine_options: dict, label: str | None = None
) -> list[RestoreResult]:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    results = [RestoreResult(label or model, n) for n in lengths]
    with tempfile.TemporaryDirectory(prefix="kv-restore-") as kv_dir:
        opts = {"kv_disk_dir": kv_dir, **engine_options}
        cases = [(r, k) for r in results for k in range(repeats)]
        histories = {}
        with LLM(model, **opts) as llm:
            vocab = llm.engine.model.config.vocab_size
            llm.generate([_tokens(64, -1, vocab)], one)  # warm-up
            for res, k in tqdm(cases, desc=f"{label or model}: recompute, RAM", unit="case"):
                hist = _tokens(res.history_tokens, 1000 * res.history_tokens + k, vocab)
                histories[res.history_tokens, k] = hist
                # Recompute; as a session, so the history is written through to both tiers.
                out = llm.generate([hist + _tokens(QUESTION_TOKENS, 1, vocab)], one, session_id="s")
                res.record("recompute", out[0].metrics.ttft, out[0].metrics.num_cached_tokens)
                llm.engine.reset_prefix_cache()
                out = llm.generate([hist + _tokens(QUESTION_TOKENS, 2, vocab)], one)
                res.record("ram", out[0].metrics.ttft, out[0].metrics.num_cached_tokens)
        # A restart: an empty pool and RAM tier; the disk tier finds last run's files.
        with LLM(model, **opts) as llm:
            llm.generate([_tokens(64, -2, vocab)], one)
            _drop_page_cache(Path(kv_dir))  # after the start-up scan read every header
            for res, k in tqdm(cases, desc=f"{label or model}: disk", unit="case"):
                hist = histories[res.history_tokens, k]
                out = llm.generate([hist + _tokens(QUESTION_TOKENS, 3, vocab)], one)
                res.record("disk", out[0].metrics.ttft, out[0].metrics.num_cached_tokens)
    return results


def restore_table(results: list[RestoreResult]) -> str:
    lines = [
        "| model | history tokens | recompute TTFT s | RAM TTFT s | disk TTFT s "
        "| RAM speed-up | disk speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        base = r.median("recompute")
        lines.append(
            f"| {r.model} | {r.history_tokens} | {base:.3f} | {r.median('ram'):.3f} "
            f"| {r.median('disk'):.3f} | {base / r.median('ram'):.1f}× "
            f"| {base / r.median('disk'):.1f}× |"
        )
    return "\n".join(lines)


def restore_plot(results: list[RestoreResult], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(SOURCES)
    labels = [f"{r.model}\n{r.history_tokens} tokens" for r in results]
    for i, source in enumerate(SOURCES):
        xs = [j + (i - 1) * width for j in range(len(results))]
        ys = [r.median(source) for r in results]
        ax.bar(xs, ys, width, label=source)
        for x, y in zip(xs, ys, strict=True):
            ax.annotate(f"{y:.2f}", (x, y), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, s (median; log scale)")
    ax.set_title("Cold restore of a student's history: recompute vs RAM tier vs disk tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def as_json(results: list[RestoreResult]) -> list[dict]:
    return [asdict(r) for r in results]
