"""`tutorserve tutor costs`: model tokens and seconds from the store, totalled by school, course,
agent (or model, tier, learner, session), as a table and a bar plot."""

from __future__ import annotations

from pathlib import Path

from tutorserve.tutor.usage_store import Totals


def costs_table(totals: list[Totals], by: str) -> str:
    rows = [
        f"| {by} | model calls | prompt tokens | of which prefix-cached | generated tokens "
        "| model seconds | tokens saved by the reply cache |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in totals:
        rows.append(
            f"| {t.key} | {t.calls} | {t.prompt_tokens} | {t.cached_tokens} | "
            f"{t.generated_tokens} | {t.seconds:.1f} | {t.saved_tokens} |"
        )
    total = Totals("total", *(sum(getattr(t, f) for t in totals) for f in (
        "calls", "prompt_tokens", "cached_tokens", "generated_tokens", "seconds", "saved_tokens"
    )))  # fmt: skip
    rows.append(
        f"| **{total.key}** | {total.calls} | {total.prompt_tokens} | {total.cached_tokens} | "
        f"{total.generated_tokens} | {total.seconds:.1f} | {total.saved_tokens} |"
    )
    return "\n".join(rows)


def plot_costs(totals: list[Totals], by: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [t.key for t in totals][::-1]
    fresh = [(t.prompt_tokens - t.cached_tokens) / 1e3 for t in totals][::-1]
    cached = [t.cached_tokens / 1e3 for t in totals][::-1]
    generated = [t.generated_tokens / 1e3 for t in totals][::-1]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(keys) + 1.5))
    ax.barh(keys, fresh, color="#2f6fde", label="prompt (computed)")
    ax.barh(keys, cached, left=fresh, color="#9bb8ef", label="prompt (prefix cache)")
    left = [a + b for a, b in zip(fresh, cached, strict=True)]
    ax.barh(keys, generated, left=left, color="#d98a1c", label="generated")
    ax.set(xlabel="thousand tokens", title=f"tutor model tokens by {by}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
