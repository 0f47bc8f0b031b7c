"""Costs in the tutor store: each learner's school (tenant) and every model call of every turn,
charged to its learner, session, course, school, agent and model; totals by any of these for
`tutorserve tutor costs`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import sessionmaker

from tutorserve.tutor.costs import DIMENSIONS, Call
from tutorserve.tutor.store import TutorStore
from tutorserve.tutor.tables import TenantRow, UsageRow

DEFAULT_TENANT = "default"
_COLUMNS = (UsageRow.tenant, UsageRow.course_id, UsageRow.agent, UsageRow.model, UsageRow.tier,
            UsageRow.learner_id, UsageRow.session_id)  # fmt: skip
BY = dict(zip(DIMENSIONS, _COLUMNS, strict=True))


@dataclass(frozen=True, slots=True)
class Charge:
    """Who a turn's calls are charged to."""

    learner_id: str
    session_id: str
    course_id: str
    tenant: str


@dataclass(frozen=True, slots=True)
class Totals:
    key: str
    calls: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    seconds: float
    saved_tokens: int

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


class UsageStore:
    def __init__(self, store: TutorStore) -> None:
        self._sessions = sessionmaker(store.engine, expire_on_commit=False)

    def set_tenant(self, learner_id: str, tenant: str) -> None:
        """The learner (who must exist) belongs to `tenant` from now on."""
        for attempt in range(2):
            try:
                with self._sessions.begin() as s:
                    row = s.get(TenantRow, learner_id)
                    if row is None:
                        s.add(TenantRow(learner_id=learner_id, tenant=tenant))
                    else:
                        row.tenant = tenant
                return
            except sa_exc.IntegrityError:
                if attempt:  # a concurrent first session inserted it: now an update
                    raise

    def tenant_of(self, learner_id: str) -> str:
        with self._sessions() as s:
            row = s.get(TenantRow, learner_id)
            return row.tenant if row is not None else DEFAULT_TENANT

    def add(self, charge: Charge, calls: Iterable[Call]) -> None:
        now = datetime.now(UTC)
        who = {"created_at": now, "learner_id": charge.learner_id,
               "session_id": charge.session_id, "course_id": charge.course_id,
               "tenant": charge.tenant}  # fmt: skip
        rows = [UsageRow(**who, **_columns(c)) for c in calls]
        if rows:
            with self._sessions.begin() as s:
                s.add_all(rows)

    def totals(self, by: str) -> list[Totals]:
        """Sums per value of `by` (one of BY), most tokens first."""
        if by not in BY:
            raise ValueError(f"costs by {by!r}? one of: {', '.join(BY)}")
        col = BY[by]
        spent = sa.not_(UsageRow.cached_reply)
        query = (
            sa.select(
                col,
                sa.func.count().filter(spent),
                sa.func.coalesce(sa.func.sum(UsageRow.prompt_tokens), 0),
                sa.func.coalesce(sa.func.sum(UsageRow.cached_tokens), 0),
                sa.func.coalesce(sa.func.sum(UsageRow.generated_tokens), 0),
                sa.func.coalesce(sa.func.sum(UsageRow.seconds), 0.0),
                sa.func.coalesce(sa.func.sum(UsageRow.saved_tokens), 0),
            )
            .group_by(col)
            .order_by(col)
        )
        with self._sessions() as s:
            found = [Totals(str(r[0]), *map(int, r[1:5]), float(r[5]), int(r[6]))
                     for r in s.execute(query)]  # fmt: skip
        return sorted(found, key=lambda t: -t.tokens)


def _columns(c: Call) -> dict[str, object]:
    return {
        "agent": c.agent,
        "model": c.model,
        "tier": c.tier.label,
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "generated_tokens": c.generated_tokens,
        "seconds": c.seconds,
        "cached_reply": c.cached_reply,
        "saved_tokens": c.saved_tokens,
    }
