"""Answer logs (one row per attempt: user, KC, right or wrong) as BKT sequences."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import numpy as np

Sequences = list[tuple[int, np.ndarray]]


def load_attempts(path: str | Path) -> tuple[dict[str, list[tuple[str, int]]], list[str]]:
    """Attempts per user in file order, and the KC names. Columns: user_id, skill_name,
    correct (as in the ASSISTments "builder" export)."""
    users: dict[str, list[tuple[str, int]]] = {}
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"user_id", "skill_name", "correct"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        for row in reader:
            if row["correct"] not in ("0", "1"):
                raise ValueError(f"{path}: correct must be 0 or 1, got {row['correct']!r}")
            users.setdefault(row["user_id"], []).append((row["skill_name"], int(row["correct"])))
    kcs = sorted({kc for attempts in users.values() for kc, _ in attempts})
    return users, kcs


def split_users(
    users: dict[str, list[tuple[str, int]]], test_fraction: float, seed: int
) -> tuple[list[str], list[str]]:
    ids = sorted(users)
    random.Random(seed).shuffle(ids)
    n_test = max(1, round(len(ids) * test_fraction))
    return ids[n_test:], ids[:n_test]


def to_sequences(
    users: dict[str, list[tuple[str, int]]], ids: list[str], kc_index: dict[str, int]
) -> Sequences:
    """One sequence per (user, KC): that user's answers on that KC, in order."""
    out: Sequences = []
    for user in ids:
        per_kc: dict[int, list[int]] = {}
        for kc, correct in users[user]:
            per_kc.setdefault(kc_index[kc], []).append(correct)
        out += [(kc, np.array(a, dtype=np.float64)) for kc, a in per_kc.items()]
    return out
