"""The tutor store's tables (SQLAlchemy ORM): learners, sessions, turns, per-KC mastery,
solved problems, and each learner's school with the model calls charged to it.
Portable types only, so SQLite and PostgreSQL share the schema."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class UTCDateTime(sa.TypeDecorator[datetime]):
    """Timezone-aware UTC both ways: SQLite keeps no offset and would hand back naive times."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return None if value is None else value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {datetime: UTCDateTime, dict: sa.JSON}


class LearnerRow(Base):
    __tablename__ = "learners"
    id: Mapped[str] = mapped_column(primary_key=True)
    created_at: Mapped[datetime]


# Defined before SessionRow, whose num_turns counts these rows.
class TurnRow(Base):
    __tablename__ = "turns"
    session_id: Mapped[str] = mapped_column(sa.ForeignKey("sessions.id"), primary_key=True)
    index: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    message: Mapped[str]
    reply: Mapped[str]
    diagnosis: Mapped[dict]
    ladder_level: Mapped[int]
    mastery_changes: Mapped[dict]
    timing: Mapped[dict]
    engage: Mapped[str | None]
    created_at: Mapped[datetime]


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(sa.String(32), primary_key=True)
    learner_id: Mapped[str] = mapped_column(sa.ForeignKey("learners.id"), index=True)
    course_id: Mapped[str]
    problem_id: Mapped[str | None]
    created_at: Mapped[datetime]
    num_turns: Mapped[int] = sa.orm.column_property(
        sa.select(sa.func.count()).where(TurnRow.session_id == id).scalar_subquery()
    )


class MasteryRow(Base):
    __tablename__ = "mastery"
    learner_id: Mapped[str] = mapped_column(sa.ForeignKey("learners.id"), primary_key=True)
    course_id: Mapped[str] = mapped_column(primary_key=True)
    kc_id: Mapped[str] = mapped_column(primary_key=True)
    p_mastery: Mapped[float]
    attempts: Mapped[int]
    errors: Mapped[int]
    consecutive_errors: Mapped[int]
    updated_at: Mapped[datetime]


class SolvedRow(Base):
    __tablename__ = "solved"
    learner_id: Mapped[str] = mapped_column(sa.ForeignKey("learners.id"), primary_key=True)
    course_id: Mapped[str] = mapped_column(primary_key=True)
    problem_id: Mapped[str] = mapped_column(primary_key=True)


class TenantRow(Base):
    """The school (tenant) a learner belongs to, charged for their turns."""

    __tablename__ = "tenants"
    learner_id: Mapped[str] = mapped_column(sa.ForeignKey("learners.id"), primary_key=True)
    tenant: Mapped[str] = mapped_column(index=True)


class UsageRow(Base):
    """One model call of a turn (or one reply-cache hit: no tokens spent, `saved_tokens`)."""

    __tablename__ = "usage"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    created_at: Mapped[datetime]
    learner_id: Mapped[str] = mapped_column(index=True)
    session_id: Mapped[str] = mapped_column(index=True)
    course_id: Mapped[str]
    tenant: Mapped[str] = mapped_column(index=True)
    agent: Mapped[str]
    model: Mapped[str]
    tier: Mapped[str]
    prompt_tokens: Mapped[int]
    cached_tokens: Mapped[int]
    generated_tokens: Mapped[int]
    seconds: Mapped[float]
    cached_reply: Mapped[bool]
    saved_tokens: Mapped[int]
