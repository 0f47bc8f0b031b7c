"""Deep knowledge tracing (DKT, Piech et al. 2015), the variant that reads the question first:
an LSTM runs over a student's whole answer log, all KCs interleaved, and P(right) of answer t
comes from its state after answers 0..t-1 together with the KC of question t.

Unlike BKT, which keeps one independent chain per KC, the state can carry what the student's
answers on other KCs say about them (overall ability, a bad day); the price is that it has no
per-KC P(known) to show a teacher.

Training is on fixed-length windows of each log (the state restarts at every window), the
epoch kept is the one with the lowest log-loss on students held out from the training log,
and prediction runs each test log whole. Seeded runs on one thread repeat bit for bit.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn.functional import binary_cross_entropy_with_logits
from tqdm import tqdm

log = logging.getLogger(__name__)

# Per student: KC index of each question and its 0/1 answer, in order.
Logs = list[tuple[np.ndarray, np.ndarray]]


@dataclass(slots=True)
class DKTConfig:
    hidden: int = 64
    epochs: int = 20
    window: int = 200
    batch: int = 32
    lr: float = 1e-3
    dropout: float = 0.2
    val_fraction: float = 0.1  # of the training students, to choose the epoch
    seed: int = 0
    threads: int = 1


class DKT(nn.Module):
    def __init__(self, num_kcs: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.num_kcs = num_kcs
        # (KC, right/wrong) of the previous answer; the last row starts every log.
        self.answer = nn.Embedding(2 * num_kcs + 1, hidden)
        self.question = nn.Embedding(num_kcs, hidden)
        self.rnn = nn.LSTM(hidden, hidden, batch_first=True)
        self.head = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, kc: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
        """Logits of P(right) for every [student, step], each from the earlier steps only."""
        previous = kc * 2 + correct
        start = torch.full_like(previous[:, :1], 2 * self.num_kcs)
        state, _ = self.rnn(self.answer(torch.cat([start, previous[:, :-1]], 1)))
        return self.head(torch.cat([state, self.question(kc)], -1)).squeeze(-1)

    @torch.no_grad()
    def stand_in_for_unseen(self, seen: np.ndarray) -> None:
        """KCs without training answers (new in a test log) get the mean embedding of the
        seen ones, so they are predicted like an average KC rather than from random init."""
        unseen = np.flatnonzero(~seen)
        if len(unseen) == 0:
            return
        rows = torch.as_tensor(np.flatnonzero(seen))
        self.question.weight[unseen] = self.question.weight[rows].mean(0)
        for right in (0, 1):
            self.answer.weight[unseen * 2 + right] = self.answer.weight[rows * 2 + right].mean(0)


def _pad(logs: Logs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(kc) for kc, _ in logs)
    kc = torch.zeros(len(logs), n, dtype=torch.long)
    correct = torch.zeros(len(logs), n, dtype=torch.long)
    mask = torch.zeros(len(logs), n, dtype=torch.bool)
    for i, (k, c) in enumerate(logs):
        kc[i, : len(k)] = torch.as_tensor(k)
        correct[i, : len(k)] = torch.as_tensor(c)
        mask[i, : len(k)] = True
    return kc, correct, mask


def _loss(model: DKT, batch: Logs) -> torch.Tensor:
    kc, correct, mask = _pad(batch)
    return binary_cross_entropy_with_logits(model(kc, correct)[mask], correct[mask].float())


def _predict(model: DKT, logs: Logs, batch: int) -> np.ndarray:
    was_training = model.training
    model.eval()
    # Similar lengths share a batch so little of it is padding; results go back in input order.
    order = sorted(range(len(logs)), key=lambda i: len(logs[i][0]))
    out: list[np.ndarray] = [np.empty(0)] * len(logs)
    with torch.no_grad():
        for s in range(0, len(order), batch):
            chunk = order[s : s + batch]
            kc, correct, _ = _pad([logs[i] for i in chunk])
            p = torch.sigmoid(model(kc, correct)).numpy()
            for row, i in enumerate(chunk):
                out[i] = p[row, : len(logs[i][0])]
    model.train(was_training)
    return np.concatenate(out) if out else np.empty(0)


def train_dkt(
    logs: Logs, num_kcs: int, cfg: DKTConfig, progress: bool = False
) -> tuple[DKT, list[float]]:
    """Fit on the students' logs; returns the model at its best epoch and the validation
    log-loss after each epoch."""
    if len(logs) < 2:
        raise ValueError("DKT needs at least 2 training students (some are held out to validate)")
    if cfg.epochs < 1:
        raise ValueError("DKT needs at least 1 epoch")
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        torch.manual_seed(cfg.seed)
        rng = np.random.default_rng(cfg.seed)
        order = rng.permutation(len(logs))
        n_val = min(len(logs) - 1, max(1, round(len(logs) * cfg.val_fraction)))
        val = [logs[i] for i in order[:n_val]]
        windows = [
            (kc[s : s + cfg.window], c[s : s + cfg.window])
            for kc, c in (logs[i] for i in order[n_val:])
            for s in range(0, len(kc), cfg.window)
        ]
        model = DKT(num_kcs, cfg.hidden, cfg.dropout)
        seen = np.zeros(num_kcs, dtype=bool)
        for kc, _ in windows:
            seen[kc] = True
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        batches = -(-len(windows) // cfg.batch)
        history: list[float] = []
        best: dict[str, torch.Tensor] = {}
        bar = tqdm(
            total=cfg.epochs * batches, desc="training DKT", unit="batch", disable=not progress
        )
        for epoch in range(cfg.epochs):
            shuffled = rng.permutation(len(windows))
            for s in range(0, len(windows), cfg.batch):
                loss = _loss(model, [windows[i] for i in shuffled[s : s + cfg.batch]])
                opt.zero_grad()
                loss.backward()
                opt.step()
                bar.update()
            history.append(_log_loss(val, _predict(model, val, cfg.batch)))
            bar.set_postfix(val_logloss=f"{history[-1]:.4f}")
            log.info("DKT epoch %d: validation log-loss %.4f", epoch + 1, history[-1])
            if history[-1] == min(history):
                best = copy.deepcopy(model.state_dict())
        bar.close()
        model.load_state_dict(best)
        model.stand_in_for_unseen(seen)
        model.eval()
        return model, history
    finally:
        torch.set_num_threads(threads)


def predict_dkt(model: DKT, logs: Logs, threads: int = 1, batch: int = 16) -> np.ndarray:
    """P(right) of every answer before it is seen, student by student in log order."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _predict(model, logs, batch)
    finally:
        torch.set_num_threads(before)


def _log_loss(logs: Logs, p: np.ndarray) -> float:
    y = np.concatenate([c for _, c in logs])
    p = p.clip(1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))
