"""What the simulator is driven by: the serving benchmark's own workloads and arrival times, as
token ids the server would see, and a district's cohort of students scaled up from them."""

from __future__ import annotations

import random
from dataclasses import dataclass

from tutorserve.bench.arrivals import arrival_times
from tutorserve.bench.workloads import Session, serving_workload
from tutorserve.models.tokenizer import Tokenizer
from tutorserve.sim.simulator import SimSession, SimTurn

_MARK = "\u2063ANSWER\u2063"  # stands for the tutor's reply while a later turn is rendered


def as_tokens(tok: Tokenizer, session: Session) -> list[list[int]]:
    """Per turn, the ids it adds to the conversation: the first turn's whole prompt, then what
    follows the previous reply (template glue, the student's message, the assistant header).
    The reply itself is the engine's (in the simulator, stand-in ids)."""
    out = [tok.encode_chat(session.messages([], 0))]
    for k in range(1, len(session.turns)):
        text = tok.apply_chat_template(session.messages([_MARK] * k, k))
        out.append(tok.encode(text.rsplit(_MARK, 1)[1], add_special_tokens=False))
    return out


def serving_sessions(
    tok: Tokenizer,
    workload: str,
    num_requests: int,
    rate: float,
    *,
    burstiness: float = 1.0,
    arrival: str = "gamma",
    seed: int = 0,
) -> list[SimSession]:
    """`bench serve`'s workload with its arrival times (same seed: the same sessions at the
    same moments as the measured run)."""
    sessions = serving_workload(tok, workload, num_requests, seed)
    starts = arrival_times(len(sessions), rate, burstiness=burstiness, profile=arrival, seed=seed)
    return [
        SimSession(
            [
                SimTurn(ids, t.max_tokens, t.think_time_s)
                for ids, t in zip(as_tokens(tok, s), s.turns, strict=True)
            ],
            start,
            s.course,
        )
        for s, start in zip(sessions, starts, strict=True)
    ]


@dataclass(frozen=True, slots=True)
class Cohort:
    """A district's evening, per replica's share of it: how students use the tutor.

    Defaults are stated assumptions, not measurements: a course prompt of 1,500 tokens (a
    syllabus and persona, as `edu-shared-prefix`), students' messages of 20–60 tokens, replies
    of 32–96 tokens (Socratic questions are short), 6 turns a session with 20–60 s between a
    reply and the next message (reading and typing), and 40 courses across the district.
    """

    courses: int = 40
    course_prompt_tokens: int = 1500
    turns: int = 6
    message_tokens: tuple[int, int] = (20, 60)
    reply_tokens: tuple[int, int] = (32, 96)
    think_time_s: tuple[float, float] = (20.0, 60.0)

    def turn_interval_s(self) -> float:
        """Mean seconds from one message of a student to the next, less the reply's time."""
        return sum(self.think_time_s) / 2

    def sessions(self, vocab: int, num_sessions: int, rate: float, seed: int) -> list[SimSession]:
        """`num_sessions` sessions starting as a Poisson stream at `rate` per second. Token ids
        are random (the simulator only compares them): a course's prompt is the same for all its
        students, each message and reply the student's own."""
        rng = random.Random(seed)
        prompts = [[rng.randrange(vocab) for _ in range(self.course_prompt_tokens)]
                   for _ in range(self.courses)]  # fmt: skip
        starts = arrival_times(num_sessions, rate, seed=seed)
        out = []
        for start in starts:
            course = rng.randrange(self.courses)
            turns = []
            for k in range(self.turns):
                message = [rng.randrange(vocab) for _ in range(rng.randint(*self.message_tokens))]
                turns.append(SimTurn(
                    (prompts[course] if k == 0 else []) + message,
                    rng.randint(*self.reply_tokens),
                    0.0 if k == 0 else rng.uniform(*self.think_time_s),
                ))  # fmt: skip
            out.append(SimSession(turns, start, course))
        return out
