"""Bayesian Knowledge Tracing: per knowledge component (KC), a two-state hidden Markov model of
whether the student knows it (prior, learn, optional forget) emitting right or wrong answers
(guess, slip). `update` is the per-answer filter the tutor runs; `fit_bkt` learns each KC's
parameters by expectation–maximization (Baum–Welch) over many students' answer sequences.

The EM pass runs over all sequences of all KCs at once, time step by time step: sequences are
sorted longest first, so at step t the active ones are a prefix and every array is flat
(total answers), with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

_EPS = 1e-6
# Parameters stay inside [_BOUND, 1 - _BOUND]: a state probability driven to ~0 would make the
# scaled backward messages (about 1 / that probability) overflow on long sequences.
_BOUND = 1e-3


@dataclass(slots=True)
class BKTParams:
    prior: float = 0.3
    learn: float = 0.1
    slip: float = 0.1
    guess: float = 0.2
    forget: float = 0.0

    def p_correct(self, mastery: float) -> float:
        """Probability of a right answer given P(known) before it."""
        return mastery * (1 - self.slip) + (1 - mastery) * self.guess

    def update(self, mastery: float, correct: bool) -> float:
        """P(known) after observing one answer and one learning opportunity."""
        if correct:
            known = mastery * (1 - self.slip)
            posterior = known / (known + (1 - mastery) * self.guess)
        else:
            known = mastery * self.slip
            posterior = known / (known + (1 - mastery) * (1 - self.guess))
        return posterior * (1 - self.forget) + (1 - posterior) * self.learn


@dataclass(slots=True)
class _Layout:
    """Sequences sorted longest first; cell (t, i) of the i-th sequence lives at
    starts[t] + i, for i < active[t]."""

    kc: np.ndarray  # [sequences] KC index of each sequence
    active: np.ndarray  # [max_len] sequences still running at step t
    starts: np.ndarray  # [max_len + 1] offset of step t in the flat arrays
    obs: np.ndarray  # [answers] 1 = right, in (t, sequence) order


def _layout(sequences: list[tuple[int, np.ndarray]]) -> _Layout:
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][1]))
    seqs = [sequences[i] for i in order]
    lengths = np.array([len(s) for _, s in seqs])
    max_len = int(lengths[0])
    active = np.array([(lengths > t).sum() for t in range(max_len)])
    starts = np.concatenate([[0], np.cumsum(active)])
    obs = np.empty(starts[-1], dtype=np.float64)
    for t in range(max_len):
        obs[starts[t] : starts[t + 1]] = [s[t] for _, s in seqs[: active[t]]]
    return _Layout(np.array([k for k, _ in seqs]), active, starts, obs)


def _forward(lay: _Layout, p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell: P(known) before the answer (the prediction), after it (filtered), and the
    probability of the answer given the past (the scaling factor). `p`: [KCs, 5] parameters."""
    prior, learn, slip, guess, forget = (p[lay.kc, j] for j in range(5))
    before = np.empty_like(lay.obs)
    after = np.empty_like(lay.obs)
    scale = np.empty_like(lay.obs)
    known = prior
    for t, n in enumerate(lay.active):
        cells = slice(lay.starts[t], lay.starts[t + 1])
        o = lay.obs[cells]
        if t:
            prev = after[lay.starts[t - 1] : lay.starts[t - 1] + n]
            known = prev * (1 - forget[:n]) + (1 - prev) * learn[:n]
        e_known = np.where(o > 0, 1 - slip[:n], slip[:n])
        e_unknown = np.where(o > 0, guess[:n], 1 - guess[:n])
        joint = known * e_known
        c = joint + (1 - known) * e_unknown
        # Never exactly 0 or 1: the backward pass must be able to weigh both states.
        before[cells], after[cells], scale[cells] = known, (joint / c).clip(1e-12, 1 - 1e-12), c
    return before, after, scale


def _em_step(lay: _Layout, p: np.ndarray, forgetting: bool) -> tuple[np.ndarray, float]:
    """One Baum–Welch iteration; returns new parameters and the data log-likelihood."""
    _, after, scale = _forward(lay, p)
    _, learn, slip, guess, forget = (p[lay.kc, j] for j in range(5))
    n_kc = p.shape[0]
    # Backward pass for the smoothed P(known) (gamma) and the expected transitions (xi).
    gamma = np.empty_like(after)
    xi_learn = np.zeros(n_kc)  # expected unknown → known
    xi_forget = np.zeros(n_kc)  # expected known → unknown
    from_unknown = np.zeros(n_kc)
    from_known = np.zeros(n_kc)
    max_len = len(lay.active)
    beta_k = np.ones(lay.active[-1])
    beta_u = np.ones(lay.active[-1])
    for t in range(max_len - 1, -1, -1):
        n = lay.active[t]
        cells = slice(lay.starts[t], lay.starts[t + 1])
        a = after[cells]
        g = a * beta_k[:n]
        g /= g + (1 - a) * beta_u[:n]
        gamma[cells] = g
        if t == 0:
            break
        # Messages to step t-1 (only sequences active at t continue back). Each step's
        # transition posteriors are normalized and the backward messages rescaled to sum to
        # one: P(unknown) can fall to ~0 over a long run of right answers, and unscaled
        # messages (about its inverse) would overflow.
        o = lay.obs[cells]
        to_k = np.where(o > 0, 1 - slip[:n], slip[:n]) * beta_k[:n]
        to_u = np.where(o > 0, guess[:n], 1 - guess[:n]) * beta_u[:n]
        prev = after[lay.starts[t - 1] : lay.starts[t - 1] + n]
        uk = (1 - prev) * learn[:n] * to_k
        uu = (1 - prev) * (1 - learn[:n]) * to_u
        kk = prev * (1 - forget[:n]) * to_k
        ku = prev * forget[:n] * to_u
        z = uk + uu + kk + ku
        kc = lay.kc[:n]
        xi_learn += np.bincount(kc, uk / z, n_kc)
        xi_forget += np.bincount(kc, ku / z, n_kc)
        from_unknown += np.bincount(kc, (uk + uu) / z, n_kc)
        from_known += np.bincount(kc, (kk + ku) / z, n_kc)
        beta_k = (1 - forget[:n]) * to_k + forget[:n] * to_u
        beta_u = learn[:n] * to_k + (1 - learn[:n]) * to_u
        total = beta_k + beta_u
        beta_k, beta_u = beta_k / total, beta_u / total
        m = lay.active[t - 1]
        if m > n:  # sequences ending at t-1 start fresh messages
            beta_k = np.concatenate([beta_k, np.ones(m - n)])
            beta_u = np.concatenate([beta_u, np.ones(m - n)])
    cell_kc = np.concatenate([lay.kc[: lay.active[t]] for t in range(max_len)])
    first = slice(0, lay.active[0])
    q = p.copy()
    count = np.bincount(lay.kc, minlength=n_kc)
    q[:, 0] = np.bincount(lay.kc, gamma[first], n_kc) / np.maximum(count, 1)
    q[:, 1] = xi_learn / np.maximum(from_unknown, _EPS)
    known_mass = np.bincount(cell_kc, gamma, n_kc)
    unknown_mass = np.bincount(cell_kc, 1 - gamma, n_kc)
    q[:, 2] = np.bincount(cell_kc, gamma * (1 - lay.obs), n_kc) / np.maximum(known_mass, _EPS)
    q[:, 3] = np.bincount(cell_kc, (1 - gamma) * lay.obs, n_kc) / np.maximum(unknown_mass, _EPS)
    q[:, 4] = xi_forget / np.maximum(from_known, _EPS) if forgetting else 0.0
    # Keep the model identifiable: a "known" state that answers worse than chance is the
    # unknown state mislabelled (the usual BKT bounds on slip and guess).
    q[:, 0:2] = q[:, 0:2].clip(_BOUND, 1 - _BOUND)
    q[:, 2:4] = q[:, 2:4].clip(_BOUND, 0.5)
    q[:, 4] = q[:, 4].clip(0, 1 - _BOUND)
    return q, float(np.log(scale).sum())


def fit_bkt(
    sequences: list[tuple[int, np.ndarray]],
    num_kcs: int,
    iterations: int = 30,
    forgetting: bool = False,
    progress: bool = False,
) -> tuple[list[BKTParams], list[float]]:
    """EM fit from (KC index, 0/1 answers in order) sequences; returns per-KC parameters and
    the log-likelihood after each iteration (non-decreasing, as EM guarantees)."""
    lay = _layout(sequences)
    p = np.tile([0.3, 0.1, 0.1, 0.2, 0.0], (num_kcs, 1)).astype(np.float64)
    history = []
    for _ in tqdm(range(iterations), desc="fitting BKT", unit="iter", disable=not progress):
        p, loglik = _em_step(lay, p, forgetting)
        history.append(loglik)
    return [BKTParams(*row) for row in p.tolist()], history


def predict(sequences: list[tuple[int, np.ndarray]], params: list[BKTParams]) -> np.ndarray:
    """P(right) of every answer before it is seen, in the same order as the answers are listed
    sequence by sequence."""
    out = []
    for kc, answers in sequences:
        bkt, mastery = params[kc], params[kc].prior
        for a in answers:
            out.append(bkt.p_correct(mastery))
            mastery = bkt.update(mastery, bool(a))
    return np.array(out)


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank-sum (Mann–Whitney) formula, ties averaged."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels > 0
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
