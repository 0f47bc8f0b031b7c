"""A learner's mastery over time, from the stored turns: per course and KC, P(known) after each
assessed answer, as a table and a plot (`tutorserve tutor plot-learner`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tutorserve.tutor.store import TutorStore


@dataclass(slots=True)
class KCTrace:
    start: float  # P(known) before the first answer
    after: list[float] = field(default_factory=list)
    correct: list[bool] = field(default_factory=list)


def learner_traces(store: TutorStore, learner_id: str) -> dict[str, dict[str, KCTrace]]:
    """course → KC → trace, over all of the learner's sessions in order."""
    if not store.learner_exists(learner_id):
        raise ValueError(f"no learner {learner_id!r} in the tutor store")
    out: dict[str, dict[str, KCTrace]] = {}
    for session in store.sessions_of(learner_id):
        kcs = out.setdefault(session.course_id, {})
        for turn in store.turns(session.id):
            for kc, change in turn.mastery_changes.items():
                trace = kcs.setdefault(kc, KCTrace(start=change["before"]))
                trace.after.append(change["after"])
                trace.correct.append(bool(turn.diagnosis.get("correct")))
    return out


def traces_table(traces: dict[str, dict[str, KCTrace]]) -> str:
    rows = ["| course | KC | answers | wrong | P(known) first → last |", "|---|---|---|---|---|"]
    for course, kcs in traces.items():
        for kc, t in kcs.items():
            span = f"{t.start:.2f} → {t.after[-1]:.2f}"
            rows.append(f"| {course} | {kc} | {len(t.after)} | {t.correct.count(False)} | {span} |")
    return "\n".join(rows)


def plot_traces(traces: dict[str, dict[str, KCTrace]], learner_id: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    courses = [c for c in traces if traces[c]] or ["(no answers yet)"]
    fig, axes = plt.subplots(1, len(courses), figsize=(6 * len(courses), 4), squeeze=False)
    for ax, course in zip(axes[0], courses, strict=True):
        for kc, t in traces.get(course, {}).items():
            xs = list(range(len(t.after) + 1))
            (line,) = ax.plot(xs, [t.start, *t.after], label=kc, lw=1.5)
            for x, p, ok in zip(xs[1:], t.after, t.correct, strict=True):
                ax.plot(x, p, "o" if ok else "x", color=line.get_color(), ms=6)
        ax.axhline(0.95, color="#999", ls="--", lw=1)
        ax.set(title=course, xlabel="answers on the KC (o right, x wrong)", ylabel="P(known)",
               ylim=(0, 1))  # fmt: skip
        if traces.get(course):
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"mastery of {learner_id} (BKT), dashed: mastered")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
