"""Knowledge tracing beyond BKT: on students simulated with a known process, DKT beats the
per-KC base rate and BKT and comes near the generating model's own AUC; `fit-kt` refuses
overlapping students and bad logs with a clear message; a prediction depends only on earlier
answers; seeded training repeats exactly."""

import csv
import json
import math
import random

import numpy as np
import pytest

from tutorserve.cli import main
from tutorserve.tutor.data import load_attempts, split_users
from tutorserve.tutor.fit import fit_kt_and_report
from tutorserve.tutor.kt import DKTConfig, predict_dkt, train_dkt
from tutorserve.tutor.learner import BKTParams, auc

TRUTH = [
    BKTParams(prior=0.2, learn=0.15, slip=0.1, guess=0.25),
    BKTParams(prior=0.5, learn=0.05, slip=0.2, guess=0.1),
    BKTParams(prior=0.1, learn=0.2, slip=0.05, guess=0.3),
    BKTParams(prior=0.3, learn=0.1, slip=0.15, guess=0.2),
]
SMALL = DKTConfig(hidden=32, epochs=8, window=60, lr=1e-2)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def simulate(first_user: int, n: int, rng: random.Random) -> tuple[list[tuple], np.ndarray]:
    """Rows (user, KC, right) and, per row, P(right) from the generating model. Each student
    answers 15 questions on each KC in turn, in random KC order, by BKT whose guess and slip
    move with a per-student ability: BKT, one chain per KC, cannot see that ability, a model
    of the whole log can infer it from the earlier KCs."""
    rows, truth = [], []
    for user in range(first_user, first_user + n):
        ability = rng.gauss(0, 1.5)
        for kc in rng.sample(range(len(TRUTH)), len(TRUTH)):
            t = TRUTH[kc]
            p = BKTParams(t.prior, t.learn, 1 / (1 + math.exp(ability - _logit(t.slip))),
                          1 / (1 + math.exp(-ability - _logit(t.guess))))  # fmt: skip
            known, mastery = rng.random() < p.prior, p.prior
            for _ in range(15):
                truth.append(p.p_correct(mastery))
                right = rng.random() < (1 - p.slip if known else p.guess)
                mastery = p.update(mastery, right)
                known = known or rng.random() < p.learn
                rows.append((f"s{user}", f"kc{kc}", int(right)))
    return rows, np.array(truth)


def write(path, rows) -> str:
    with path.open("w", newline="") as f:
        csv.writer(f).writerows([("user_id", "skill_name", "correct"), *rows])
    return str(path)


def test_dkt_beats_bkt_and_nears_the_generating_model(tmp_path):
    rng = random.Random(0)
    train, _ = simulate(0, 800, rng)
    test, truth = simulate(800, 200, rng)
    labels = np.array([r for *_, r in test], dtype=np.float64)
    table = fit_kt_and_report(write(tmp_path / "train.csv", train),
                              write(tmp_path / "test.csv", test), str(tmp_path / "out"),
                              ["bkt", "dkt"], 30, SMALL)  # fmt: skip
    result = json.loads((tmp_path / "out" / "kt.json").read_text())
    dkt, bkt = result["models"]["dkt"]["auc"], result["models"]["bkt"]["auc"]
    best = auc(labels, truth)  # the generating model, which knows each student's ability
    assert dkt > result["kc_rate_baseline"]["auc"] + 0.15
    assert dkt > bkt
    assert dkt > best - 0.04
    assert result["users"] == {"train": 800, "test": 200}
    assert "| DKT |" in table and (tmp_path / "out" / "kt.png").stat().st_size > 0


def test_seeded_training_repeats_exactly():
    rng = random.Random(1)
    rows, _ = simulate(0, 60, rng)
    users, kcs = {}, sorted({kc for _, kc, _ in rows})
    for user, kc, right in rows:
        users.setdefault(user, ([], []))
        users[user][0].append(kcs.index(kc))
        users[user][1].append(right)
    logs = [(np.array(k), np.array(c)) for k, c in users.values()]
    cfg = DKTConfig(hidden=16, epochs=2, window=30, seed=3)

    def run(config: DKTConfig) -> np.ndarray:
        return predict_dkt(train_dkt(logs, len(kcs), config)[0], logs)

    first = run(cfg)
    assert np.array_equal(first, run(cfg))
    assert not np.array_equal(first, run(DKTConfig(hidden=16, epochs=2, window=30, seed=4)))


def test_a_prediction_never_sees_its_own_answer_or_later_ones():
    rng = np.random.default_rng(0)
    logs = [(rng.integers(0, 3, 40), rng.integers(0, 2, 40)) for _ in range(20)]
    model, _ = train_dkt(logs, 3, DKTConfig(hidden=8, epochs=1, window=20))
    kc, right = logs[0]
    flipped = right.copy()
    flipped[25:] = 1 - flipped[25:]
    # Batched with the others (padding) and alone must agree, too.
    before = predict_dkt(model, logs)[:40]
    after = predict_dkt(model, [(kc, flipped)])
    assert np.allclose(before[:26], after[:26], atol=1e-6)
    assert not np.allclose(before[26:], after[26:])


def test_split_then_score_on_the_same_held_out_students(tmp_path, capsys):
    rows, _ = simulate(0, 50, random.Random(2))
    log = write(tmp_path / "log.csv", rows)
    assert main(["tutor", "fit-kt", "--split", log, "--out", str(tmp_path / "split")]) == 0
    train_users, _ = load_attempts(tmp_path / "split" / "train.csv")
    test_users, _ = load_attempts(tmp_path / "split" / "test.csv")
    train_ids, test_ids = split_users(load_attempts(log)[0], 0.2, 0)  # as fit-bkt splits
    assert (sorted(train_users), sorted(test_users)) == (sorted(train_ids), sorted(test_ids))
    # A KC only the test log has is scored with a stand-in, not from untrained parameters.
    with (tmp_path / "split" / "test.csv").open("a") as f:
        f.write(f"{test_ids[0]},new-kc,1\n{test_ids[0]},new-kc,0\n")
    argv = ["tutor", "fit-kt", "--train", str(tmp_path / "split" / "train.csv"),
            "--test", str(tmp_path / "split" / "test.csv"), "--out", str(tmp_path / "out"),
            "--epochs", "1", "--hidden", "8", "--iterations", "5"]  # fmt: skip
    assert main(argv) == 0
    assert "(1 only in the test log)" in capsys.readouterr().out
    result = json.loads((tmp_path / "out" / "kt.json").read_text())
    assert result["answers"]["test"] == 10 * 15 * 4 + 2
    for model in ("bkt", "dkt"):
        assert 0.5 < result["models"][model]["auc"] <= 1


@pytest.mark.parametrize(
    ("test_log", "message"),
    [
        (b"user_id,skill_name,correct\ns1,kc0,1\nnew,kc0,0\n", "1 student(s) are in both"),
        (b"user_id,skill,correct\nnew,kc0,1\n", "missing column(s) skill_name"),
        (b"user_id,skill_name,correct\nnew,kc0,yes\n", "line 2: correct must be 0 or 1"),
        (b"user_id,skill_name,correct\nnew,kc0\n", "line 2: too few fields"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not a CSV answer log"),
        (b"user_id,skill_name,correct\n", "no answers"),
        (b"user_id,skill_name,correct\nnew,kc0,1\nnew,kc0,1\n", "AUC needs both"),
    ],
)
def test_bad_test_logs_are_refused_clearly(tmp_path, capsys, test_log, message):
    train = write(tmp_path / "train.csv", [("s1", "kc0", 1), ("s2", "kc0", 0)])
    (tmp_path / "test.csv").write_bytes(test_log)
    argv = ["tutor", "fit-kt", "--train", train, "--test", str(tmp_path / "test.csv"),
            "--out", str(tmp_path / "out"), "--model", "bkt"]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_arguments_and_files_are_refused_clearly(tmp_path, capsys):
    assert main(["tutor", "fit-kt", "--train", str(tmp_path / "none.csv")]) == 2
    assert "give --train and --test" in capsys.readouterr().err
    argv = ["tutor", "fit-kt", "--train", str(tmp_path / "none.csv"), "--test", "x.csv"]
    assert main(argv) == 2
    assert "no answer log at" in capsys.readouterr().err
