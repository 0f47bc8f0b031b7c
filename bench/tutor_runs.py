"""Several `tutorserve bench tutor` runs side by side: where each run's engine time went (steps
that compute a prompt, steps that verify drafts, plain decode steps) and its explain step.

    .venv/bin/python bench/tutor_runs.py OUT.png DIR [DIR ...]   # each DIR holds a tutor.json

Meant for runs that computed the same turns (`bench tutor --greedy --batch-invariant`), so the
bars differ only in speed; the folder names label the bars.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tutorserve.bench.tutor_turns import median_p90

KINDS = (("prefill", "steps computing a prompt"), ("verify", "verifying drafts"),
         ("decode", "plain decode"))  # fmt: skip


def main(out: str, folders: list[str]) -> None:
    runs = {Path(f).name: json.loads((Path(f) / "tutor.json").read_text()) for f in folders}
    names = list(runs)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.5 * len(names) + 2.5), sharey=True)
    start = [0.0] * len(names)
    for kind, label in KINDS:
        secs = [runs[n]["counters"].get(f"{kind}_seconds", 0.0) for n in names]
        left.barh(names, secs, left=start, label=label)
        start = [a + b for a, b in zip(start, secs, strict=True)]
    left.set_xlabel("engine seconds")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)
    explain = [median_p90([t["steps_ms"]["explain"] for t in runs[n]["turns"]]) for n in names]
    for i, label in enumerate(("median", "p90")):
        right.plot([e[i] for e in explain], names, "o", label=label)
    right.set_xlabel("explain step, ms")
    right.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2:])
