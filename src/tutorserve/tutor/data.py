"""Answer logs (one row per attempt: user, KC, right or wrong) as BKT sequences."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import numpy as np

Sequences = list[tuple[int, np.ndarray]]
# Per user: (KC name, 1 right / 0 wrong) in the order answered.
Attempts = dict[str, list[tuple[str, int]]]
COLUMNS = ("user_id", "skill_name", "correct")


def load_attempts(path: str | Path) -> tuple[Attempts, list[str]]:
    """Attempts per user in file order, and the KC names. Columns: user_id, skill_name,
    correct (as in the ASSISTments "builder" export)."""
    users: Attempts = {}
    try:
        with Path(path).open(newline="") as f:
            reader = csv.DictReader(f)
            missing = set(COLUMNS) - set(reader.fieldnames or [])
            if missing:
                raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
            for row in reader:
                user, kc, correct = (row[c] for c in COLUMNS)
                if None in (user, kc, correct):
                    raise ValueError(f"{path} line {reader.line_num}: too few fields")
                if correct not in ("0", "1"):
                    raise ValueError(
                        f"{path} line {reader.line_num}: correct must be 0 or 1, got {correct!r}"
                    )
                users.setdefault(user, []).append((kc, int(correct)))
    except (csv.Error, UnicodeDecodeError) as e:  # e.g. a binary file given by mistake
        raise ValueError(f"{path}: not a CSV answer log ({e})") from e
    kcs = sorted({kc for attempts in users.values() for kc, _ in attempts})
    return users, kcs


def split_users(users: Attempts, test_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    ids = sorted(users)
    random.Random(seed).shuffle(ids)
    n_test = max(1, round(len(ids) * test_fraction))
    return ids[n_test:], ids[:n_test]


def to_sequences(users: Attempts, ids: list[str], kc_index: dict[str, int]) -> Sequences:
    """One sequence per (user, KC): that user's answers on that KC, in order."""
    out: Sequences = []
    for user in ids:
        per_kc: dict[int, list[int]] = {}
        for kc, correct in users[user]:
            per_kc.setdefault(kc_index[kc], []).append(correct)
        out += [(kc, np.array(a, dtype=np.float64)) for kc, a in per_kc.items()]
    return out


def write_attempts(path: Path, users: Attempts, ids: list[str]) -> None:
    """The given users' attempts, in the format `load_attempts` reads."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        writer.writerows((user, kc, correct) for user in ids for kc, correct in users[user])
