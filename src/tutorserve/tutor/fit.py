"""`tutorserve tutor fit-bkt`: fit BKT on answer logs, score next-answer prediction on held-out
users, write the parameters, the scores and plots."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from tutorserve.tutor.data import load_attempts, split_users, to_sequences
from tutorserve.tutor.learner import auc, fit_bkt, predict


def fit_and_report(
    data: str, out: str, test_fraction: float, iterations: int, forgetting: bool, seed: int
) -> str:
    if not 0 < test_fraction < 1 or iterations < 1:
        raise ValueError("--test-fraction must be in (0, 1) and --iterations >= 1")
    if not Path(data).is_file():
        raise FileNotFoundError(f"no answer log at {data} (give --data)")
    users, kcs = load_attempts(data)
    index = {kc: i for i, kc in enumerate(kcs)}
    train_ids, test_ids = split_users(users, test_fraction, seed)
    train, test = to_sequences(users, train_ids, index), to_sequences(users, test_ids, index)
    start = time.perf_counter()
    params, loglik = fit_bkt(train, len(kcs), iterations, forgetting, progress=True)
    fit_s = time.perf_counter() - start
    labels = np.concatenate([a for _, a in test])
    scores = predict(test, params)
    # Baseline: each KC's right-answer rate on the training users, ignoring the student.
    rates = np.array([
        np.concatenate([a for k, a in train if k == i] or [np.array([0.5])]).mean()
        for i in range(len(kcs))
    ])  # fmt: skip
    base = np.concatenate([np.full(len(a), rates[k]) for k, a in test])
    result = {
        "data": data,
        "users": {"train": len(train_ids), "test": len(test_ids)},
        "answers": {"train": int(sum(len(a) for _, a in train)), "test": len(labels)},
        "kcs": len(kcs),
        "iterations": iterations,
        "forgetting": forgetting,
        "fit_seconds": fit_s,
        "bkt": {"auc": auc(labels, scores), "rmse": _rmse(labels, scores)},
        "kc_rate_baseline": {"auc": auc(labels, base), "rmse": _rmse(labels, base)},
        "loglik": loglik,
        "params": {kc: asdict(p) for kc, p in zip(kcs, params, strict=True)},
    }
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bkt.json").write_text(json.dumps(result, indent=1))
    _plot(result, labels, scores, folder / "bkt.png")
    b, k = result["bkt"], result["kc_rate_baseline"]
    return "\n".join([
        f"date: {time.strftime('%Y-%m-%d')}; {len(train_ids)} training users, {len(test_ids)} "
        f"held out; {len(kcs)} KCs; {iterations} EM iterations in {fit_s:.1f} s",
        "| predictor | AUC | RMSE |",
        "|---|---|---|",
        f"| BKT (EM{' + forgetting' if forgetting else ''}) | {b['auc']:.3f} | {b['rmse']:.3f} |",
        f"| per-KC right-answer rate | {k['auc']:.3f} | {k['rmse']:.3f} |",
        f"plots: {folder / 'bkt.png'}",
    ])  # fmt: skip


def _rmse(labels: np.ndarray, scores: np.ndarray) -> float:
    return float(np.sqrt(np.mean((scores - labels) ** 2)))


def _plot(result: dict, labels: np.ndarray, scores: np.ndarray, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(range(1, len(result["loglik"]) + 1), result["loglik"])
    axes[0].set(xlabel="EM iteration", ylabel="training log-likelihood", title="EM")
    bins = np.linspace(0, 1, 11)
    which = np.clip(np.digitize(scores, bins) - 1, 0, 9)
    centers, observed, counts = [], [], []
    for b in range(10):
        mask = which == b
        if mask.any():
            centers.append(scores[mask].mean())
            observed.append(labels[mask].mean())
            counts.append(mask.sum())
    axes[1].plot([0, 1], [0, 1], "k--", lw=1)
    axes[1].scatter(centers, observed, s=np.array(counts) / max(counts) * 200)
    axes[1].set(xlabel="predicted P(right)", ylabel="observed right rate",
                title="held-out calibration")  # fmt: skip
    params = result["params"].values()
    for name in ("prior", "learn", "slip", "guess"):
        axes[2].hist([p[name] for p in params], bins=20, alpha=0.5, label=name)
    axes[2].set(xlabel="value", ylabel="KCs", title="fitted parameters per KC")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
