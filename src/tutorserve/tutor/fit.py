"""`tutorserve tutor fit-bkt` and `fit-kt`: fit learner models on answer logs, score
next-answer prediction on held-out users (AUC, RMSE), write the scores and plots."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from types import ModuleType

import numpy as np

from tutorserve.tutor.data import (
    Attempts,
    Sequences,
    load_attempts,
    split_users,
    to_sequences,
    write_attempts,
)
from tutorserve.tutor.kt import DKTConfig, predict_dkt, train_dkt
from tutorserve.tutor.learner import BKTParams, auc, fit_bkt, predict

KT_MODELS = ("bkt", "dkt")


def fit_and_report(
    data: str, out: str, test_fraction: float, iterations: int, forgetting: bool, seed: int
) -> str:
    if iterations < 1:
        raise ValueError("--iterations must be >= 1")
    users, kcs = _load(data, "--data")
    index = {kc: i for i, kc in enumerate(kcs)}
    train_ids, test_ids = _split(users, test_fraction, seed)
    train, test = to_sequences(users, train_ids, index), to_sequences(users, test_ids, index)
    start = time.perf_counter()
    params, loglik = _fit_bkt(train, len(kcs), iterations, forgetting)
    fit_s = time.perf_counter() - start
    labels = np.concatenate([a for _, a in test])
    scores = predict(test, params)
    base = _kc_rate_baseline(train, test, len(kcs))
    result = {
        "data": data,
        "users": {"train": len(train_ids), "test": len(test_ids)},
        "answers": {"train": int(sum(len(a) for _, a in train)), "test": len(labels)},
        "kcs": len(kcs),
        "iterations": iterations,
        "forgetting": forgetting,
        "fit_seconds": fit_s,
        "bkt": _metrics(labels, scores),
        "kc_rate_baseline": _metrics(labels, base),
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


def write_split(data: str, out: str, test_fraction: float, seed: int) -> str:
    """The users of one log split as fit-bkt splits them, as train.csv and test.csv."""
    users, _ = _load(data, "--split")
    train_ids, test_ids = _split(users, test_fraction, seed)
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    write_attempts(folder / "train.csv", users, train_ids)
    write_attempts(folder / "test.csv", users, test_ids)
    return (f"{len(train_ids)} training users → {folder / 'train.csv'}; {len(test_ids)} held out "
            f"→ {folder / 'test.csv'} (seed {seed})")  # fmt: skip


def fit_kt_and_report(
    train_csv: str, test_csv: str, out: str, models: list[str], iterations: int, dkt: DKTConfig
) -> str:
    """Each model trained on one log and scored on every answer of another, whose students
    must be new to it."""
    if iterations < 1 or min(dkt.epochs, dkt.hidden, dkt.threads) < 1:
        raise ValueError("--iterations, --epochs, --hidden and --threads must be >= 1")
    if not models or set(models) - set(KT_MODELS):
        raise ValueError(f"--model: choose from {', '.join(KT_MODELS)}")
    train_users, train_kcs = _load(train_csv, "--train")
    test_users, test_kcs = _load(test_csv, "--test")
    both = sorted(set(train_users) & set(test_users))
    if both:
        raise ValueError(
            f"{len(both)} student(s) are in both --train and --test (e.g. {', '.join(both[:5])}): "
            "held-out students must be new to the model (make the files with --split)"
        )
    # KCs only the test log has come last; each model gives them a stand-in.
    kcs = train_kcs + sorted(set(test_kcs) - set(train_kcs))
    index = {kc: i for i, kc in enumerate(kcs)}
    train_ids, test_ids = sorted(train_users), sorted(test_users)
    train = to_sequences(train_users, train_ids, index)
    test = to_sequences(test_users, test_ids, index)
    labels = np.concatenate([a for _, a in test])
    if labels.min() == labels.max():
        raise ValueError(f"{test_csv}: every answer is {int(labels[0])}; AUC needs both")
    result: dict = {
        "train": train_csv,
        "test": test_csv,
        "date": time.strftime("%Y-%m-%d"),
        "users": {"train": len(train_ids), "test": len(test_ids)},
        "answers": {"train": int(sum(len(a) for _, a in train)), "test": len(labels)},
        "kcs": {"train": len(train_kcs), "only_in_test": len(kcs) - len(train_kcs)},
        "bkt_iterations": iterations,
        "dkt_config": asdict(dkt),
        "models": {},
    }
    curves = {}
    for name in models:
        start = time.perf_counter()
        if name == "bkt":
            params, _ = _fit_bkt(train, len(kcs), iterations, forgetting=False)
            fit_s = time.perf_counter() - start
            y, p, extra = labels, predict(test, params), {}
        else:
            model, val_loss = train_dkt(
                _logs(train_users, train_ids, index), len(kcs), dkt, progress=True
            )
            fit_s = time.perf_counter() - start
            test_logs = _logs(test_users, test_ids, index)
            y = np.concatenate([c for _, c in test_logs]).astype(np.float64)
            p, extra = predict_dkt(model, test_logs, dkt.threads), {"val_logloss": val_loss}
        result["models"][name] = {**_metrics(y, p), "fit_seconds": fit_s, **extra}
        curves[name] = (y, p)
    curves["per-KC rate"] = (labels, _kc_rate_baseline(train, test, len(kcs)))
    result["kc_rate_baseline"] = _metrics(*curves["per-KC rate"])
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kt.json").write_text(json.dumps(result, indent=1))
    _plot_kt(result, curves, folder / "kt.png")
    rows = [(name.upper(), m["auc"], m["rmse"], f"{m['fit_seconds']:.1f}")
            for name, m in result["models"].items()]  # fmt: skip
    rows.append(("per-KC right-answer rate", *result["kc_rate_baseline"].values(), "–"))
    return "\n".join([
        f"date: {result['date']}; {len(train_ids)} training users ({train_csv}), "
        f"{len(test_ids)} held-out users ({test_csv}), {len(labels)} held-out answers; "
        f"{len(kcs)} KCs ({result['kcs']['only_in_test']} only in the test log)",
        "| predictor | AUC | RMSE | train s |",
        "|---|---|---|---|",
        *(f"| {n} | {a:.3f} | {r:.3f} | {s} |" for n, a, r, s in rows),
        f"results: {folder / 'kt.json'}; plots: {folder / 'kt.png'}",
    ])  # fmt: skip


def _load(path: str, flag: str) -> tuple[Attempts, list[str]]:
    if not Path(path).is_file():
        raise FileNotFoundError(f"no answer log at {path} (give {flag})")
    users, kcs = load_attempts(path)
    if not users:
        raise ValueError(f"{path}: no answers")
    return users, kcs


def _split(users: Attempts, test_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    if not 0 < test_fraction < 1:
        raise ValueError("--test-fraction must be in (0, 1)")
    if len(users) < 2:
        raise ValueError("the log needs at least 2 users to hold some out")
    return split_users(users, test_fraction, seed)


def _fit_bkt(
    train: Sequences, num_kcs: int, iterations: int, forgetting: bool
) -> tuple[list[BKTParams], list[float]]:
    params, loglik = fit_bkt(train, num_kcs, iterations, forgetting, progress=True)
    # EM drives the parameters of a KC without training answers to the bounds; such a KC
    # (new in the test log) gets the answer-weighted mean of the others instead.
    counts = np.bincount([k for k, a in train for _ in a], minlength=num_kcs)
    table = np.array([list(asdict(p).values()) for p in params], dtype=np.float64)
    stand_in = BKTParams(*(counts @ table / counts.sum()).tolist())
    return [p if n else stand_in for p, n in zip(params, counts, strict=True)], loglik


def _logs(users: Attempts, ids: list[str], index: dict[str, int]) -> list:
    """Per user, all answers in order: KC indices and 0/1, as DKT reads them."""
    return [(np.array([index[k] for k, _ in users[u]]), np.array([c for _, c in users[u]]))
            for u in ids]  # fmt: skip


def _kc_rate_baseline(train: Sequences, test: Sequences, num_kcs: int) -> np.ndarray:
    """Each KC's right-answer rate on the training users, ignoring the student (the overall
    rate for a KC they never answered)."""
    kc = np.array([k for k, a in train for _ in a])
    right = np.concatenate([a for _, a in train])
    n = np.bincount(kc, minlength=num_kcs)
    rates = np.where(n > 0, np.bincount(kc, right, num_kcs) / np.maximum(n, 1), right.mean())
    return np.concatenate([np.full(len(a), rates[k]) for k, a in test])


def _metrics(labels: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    return {"auc": auc(labels, scores), "rmse": float(np.sqrt(np.mean((scores - labels) ** 2)))}


def _calibration(labels: np.ndarray, scores: np.ndarray) -> tuple[list, list, list]:
    """Mean prediction, observed right rate and answers in ten bins of predicted P(right)."""
    which = np.clip(np.digitize(scores, np.linspace(0, 1, 11)) - 1, 0, 9)
    bins = [which == b for b in range(10) if (which == b).any()]
    return ([scores[m].mean() for m in bins], [labels[m].mean() for m in bins],
            [int(m.sum()) for m in bins])  # fmt: skip


def _pyplot() -> ModuleType:
    """matplotlib.pyplot, headless; imported only when a plot is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _plot(result: dict, labels: np.ndarray, scores: np.ndarray, out: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot(range(1, len(result["loglik"]) + 1), result["loglik"])
    axes[0].set(xlabel="EM iteration", ylabel="training log-likelihood", title="EM")
    centers, observed, counts = _calibration(labels, scores)
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


def _plot_kt(result: dict, curves: dict[str, tuple[np.ndarray, np.ndarray]], out: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    names = list(curves)
    aucs = [auc(*curves[n]) for n in names]
    bars = axes[0].bar(names, aucs, color=[f"C{i}" for i in range(len(names))])
    axes[0].bar_label(bars, fmt="%.3f")
    axes[0].set(ylabel="AUC", ylim=(0.5, 1), title="next-answer AUC, held-out students")
    axes[1].plot([0, 1], [0, 1], "k--", lw=1)
    for i, name in enumerate(names):
        centers, observed, _ = _calibration(*curves[name])
        axes[1].plot(centers, observed, "o-", color=f"C{i}", label=name)
    axes[1].set(xlabel="predicted P(right)", ylabel="observed right rate",
                title="held-out calibration")  # fmt: skip
    axes[1].legend()
    if "dkt" in result["models"]:
        val = result["models"]["dkt"]["val_logloss"]
        axes[2].plot(range(1, len(val) + 1), val, "o-")
    axes[2].set(xlabel="epoch", ylabel="log-loss", title="DKT, validation students")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
