"""Durable tutoring state (learners, sessions, turns, mastery, solved problems), so a restart of
the server loses nothing. One SQLAlchemy ORM repository: a SQLite file by default, PostgreSQL
when given its URL, with the same portable SQL for both."""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session, sessionmaker

from tutorserve.tutor.tables import (
    Base,
    LearnerRow,
    MasteryRow,
    SessionRow,
    SolvedRow,
    TurnRow,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
# Another process on the same database may win a race for a key (turn index, new row);
# redoing the transaction then sees its row.
_ATTEMPTS = 5


def default_url(data_dir: str | Path | None = None) -> str:
    """sqlite:///<data_dir>/tutor.db, data_dir defaulting to $TUTORSERVE_DATA_DIR or
    ~/.local/share/tutorserve; the folder is created."""
    if data_dir is None:
        data_dir = os.environ.get("TUTORSERVE_DATA_DIR") or "~/.local/share/tutorserve"
    folder = Path(data_dir).expanduser().resolve()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create tutor data folder {folder}: {e}") from e
    return f"sqlite:///{folder / 'tutor.db'}"


@dataclass(slots=True)
class SessionRecord:
    id: str
    learner_id: str
    course_id: str
    problem_id: str | None
    created_at: datetime
    num_turns: int


@dataclass(slots=True)
class TurnRecord:
    session_id: str
    index: int
    message: str
    reply: str
    diagnosis: dict
    ladder_level: int
    mastery_changes: dict
    timing: dict
    engage: str | None
    created_at: datetime


@dataclass(slots=True)
class KCState:
    p_mastery: float
    attempts: int = 0
    errors: int = 0
    consecutive_errors: int = 0


@dataclass(frozen=True, slots=True)
class Attempt:
    """What an assessed answer changes for its learner, written in the same transaction as the
    turn, so a turn is never stored without its mastery update or the other way round."""

    states: dict[str, KCState]  # the new state of each KC the problem exercises
    mastery_changes: dict[str, dict[str, float]]  # per KC: p_mastery before and after
    solved: bool
    next_problem: str | None  # when solved: the session's next problem (None: course finished)


def _record(cls: type[T], row: Any) -> T:
    """A record from the ORM row whose attributes carry the record's field names."""
    return cls(**{f.name: getattr(row, f.name) for f in fields(cls)})  # type: ignore[call-arg]


def _enable_sqlite_foreign_keys(dbapi_connection: Any, _record: Any) -> None:
    # SQLite ignores REFERENCES unless each connection turns enforcement on.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def _shown(url: str) -> str:
    """The URL for messages and logs, without its password."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return url if "@" not in url else "<unparsable URL>"


def _now() -> datetime:
    return datetime.now(UTC)


class TutorStore:
    """Every public write is one committed transaction; reads see committed data only."""

    def __init__(self, url: str | None = None) -> None:
        url = url or default_url()
        try:
            parsed = sa.make_url(url)
            sqlite = parsed.get_backend_name() == "sqlite"
            if sqlite and parsed.database and parsed.database != ":memory:":
                Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            # Worker threads share the pool, so SQLite connections must cross threads.
            args = {"check_same_thread": False} if sqlite else {}
            self.engine = sa.create_engine(url, connect_args=args)
            if sqlite:
                sa.event.listen(self.engine, "connect", _enable_sqlite_foreign_keys)
            Base.metadata.create_all(self.engine)
        except (sa_exc.ArgumentError, sa_exc.OperationalError, ImportError, OSError) as e:
            raise ValueError(f"cannot open tutor store at {_shown(url)!r}: {e}") from e
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        # SQLite has a single writer anyway; serializing this process's writes avoids busy
        # errors and keeps select-then-insert (turn index, upserts) race-free across threads.
        self._write_lock = threading.Lock()
        log.info("tutor store at %s", _shown(url))

    def close(self) -> None:
        self.engine.dispose()

    def _write(self, fn: Callable[[Session], T]) -> T:
        with self._write_lock:
            attempt = 1
            while True:
                try:
                    with self._sessions.begin() as s:
                        return fn(s)
                except sa_exc.IntegrityError:
                    if attempt == _ATTEMPTS:
                        raise
                    log.debug("write lost a key race, retrying (attempt %d)", attempt)
                    attempt += 1

    @staticmethod
    def _ensure(s: Session, learner_id: str) -> None:
        if s.get(LearnerRow, learner_id) is None:
            s.add(LearnerRow(id=learner_id, created_at=_now()))
            s.flush()

    def ensure_learner(self, learner_id: str) -> None:
        self._write(lambda s: self._ensure(s, learner_id))

    def learner_exists(self, learner_id: str) -> bool:
        with self._sessions() as s:
            return s.get(LearnerRow, learner_id) is not None

    def create_session(
        self, learner_id: str, course_id: str, problem_id: str | None
    ) -> SessionRecord:
        def go(s: Session) -> SessionRecord:
            self._ensure(s, learner_id)
            row = SessionRow(
                id=uuid.uuid4().hex,
                learner_id=learner_id,
                course_id=course_id,
                problem_id=problem_id,
                created_at=_now(),
            )
            s.add(row)
            s.flush()  # so reading num_turns below queries the new row instead of failing
            return _record(SessionRecord, row)

        return self._write(go)

    def _all(self, query: sa.Select[Any]) -> list[Any]:
        with self._sessions() as s:
            return list(s.scalars(query))

    def _update(self, model: type[Base], key: Any, **values: Any) -> None:
        """Set columns of one existing row; KeyError if there is none."""

        def go(s: Session) -> None:
            row = s.get(model, key)
            if row is None:
                raise KeyError(key)
            for name, value in values.items():
                setattr(row, name, value)

        self._write(go)

    def _session_records(self, *where: Any) -> list[SessionRecord]:
        query = sa.select(SessionRow).where(*where).order_by(SessionRow.created_at, SessionRow.id)
        return [_record(SessionRecord, r) for r in self._all(query)]

    def get_session(self, session_id: str) -> SessionRecord | None:
        found = self._session_records(SessionRow.id == session_id)
        return found[0] if found else None

    def sessions_of(self, learner_id: str) -> list[SessionRecord]:
        return self._session_records(SessionRow.learner_id == learner_id)

    def set_problem(self, session_id: str, problem_id: str | None) -> None:
        self._update(SessionRow, session_id, problem_id=problem_id)

    def add_turn(
        self,
        session_id: str,
        message: str,
        reply: str,
        diagnosis: dict,
        ladder_level: int,
        timing: dict,
        attempt: Attempt | None = None,
    ) -> int:
        """Store a turn and what its attempt changed, as one transaction; its index."""

        def go(s: Session) -> int:
            session = s.get(SessionRow, session_id)
            if session is None:
                raise KeyError(session_id)
            last = sa.select(sa.func.max(TurnRow.index)).where(TurnRow.session_id == session_id)
            found = s.scalar(last)
            index = 0 if found is None else found + 1
            s.add(
                TurnRow(
                    session_id=session_id,
                    index=index,
                    message=message,
                    reply=reply,
                    diagnosis=diagnosis,
                    ladder_level=ladder_level,
                    mastery_changes=attempt.mastery_changes if attempt else {},
                    timing=timing,
                    engage=None,
                    created_at=_now(),
                )
            )
            if attempt is not None:
                learner, course = session.learner_id, session.course_id
                self._save_mastery(s, learner, course, attempt.states)
                if attempt.solved:
                    self._mark_solved(s, learner, course, session.problem_id)
                    session.problem_id = attempt.next_problem
            return index

        return self._write(go)

    def set_engage(self, session_id: str, index: int, text: str) -> None:
        self._update(TurnRow, (session_id, index), engage=text)

    def turns(self, session_id: str) -> list[TurnRecord]:
        query = sa.select(TurnRow).where(TurnRow.session_id == session_id).order_by(TurnRow.index)
        return [_record(TurnRecord, t) for t in self._all(query)]

    def mastery(self, learner_id: str, course_id: str) -> dict[str, KCState]:
        query = sa.select(MasteryRow).where(
            MasteryRow.learner_id == learner_id, MasteryRow.course_id == course_id
        )
        return {m.kc_id: _record(KCState, m) for m in self._all(query)}

    def _save_mastery(
        self, s: Session, learner_id: str, course_id: str, states: dict[str, KCState]
    ) -> None:
        self._ensure(s, learner_id)
        now = _now()
        for kc_id, st in states.items():
            row = s.get(MasteryRow, (learner_id, course_id, kc_id))
            if row is None:
                row = MasteryRow(learner_id=learner_id, course_id=course_id, kc_id=kc_id)
                s.add(row)
            for name, value in asdict(st).items():
                setattr(row, name, value)
            row.updated_at = now

    def save_mastery(self, learner_id: str, course_id: str, states: dict[str, KCState]) -> None:
        self._write(lambda s: self._save_mastery(s, learner_id, course_id, states))

    def _mark_solved(self, s: Session, learner_id: str, course_id: str, problem_id: str) -> None:
        self._ensure(s, learner_id)
        if s.get(SolvedRow, (learner_id, course_id, problem_id)) is None:
            s.add(SolvedRow(learner_id=learner_id, course_id=course_id, problem_id=problem_id))

    def mark_solved(self, learner_id: str, course_id: str, problem_id: str) -> None:
        self._write(lambda s: self._mark_solved(s, learner_id, course_id, problem_id))

    def solved(self, learner_id: str, course_id: str) -> set[str]:
        query = sa.select(SolvedRow.problem_id).where(
            SolvedRow.learner_id == learner_id, SolvedRow.course_id == course_id
        )
        return set(self._all(query))
