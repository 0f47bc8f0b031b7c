"""Courses as data: a folder with `course.yaml` (persona, KCs), `problems.yaml` and one Markdown
explanation per KC in `kcs/<kc id>.md`. Loading validates everything an author can get wrong
(unknown KC ids, missing explanations, hints that give the answer away) and says where.
"""

from __future__ import annotations

import logging
from functools import cached_property
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from tutorserve.tutor.answers import leaks_answer, offered_values
from tutorserve.tutor.learner import BKTParams

log = logging.getLogger(__name__)
_ID = r"^[a-z0-9][a-z0-9_-]{0,63}$"
CEFR_LEVELS = ("A1", "A2", "B1", "B2", "C1", "C2")
BUILTIN = Path(str(files("tutorserve.tutor").joinpath("courses")))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BKTSpec(_Strict):
    prior: float = Field(0.2, gt=0, lt=1)
    learn: float = Field(0.15, gt=0, lt=1)
    slip: float = Field(0.1, gt=0, lt=0.5)
    guess: float = Field(0.2, gt=0, lt=0.5)
    forget: float = Field(0.0, ge=0, lt=1)

    def params(self) -> BKTParams:
        return BKTParams(self.prior, self.learn, self.slip, self.guess, self.forget)


class KC(_Strict):
    id: str = Field(pattern=_ID)
    name: str = Field(min_length=1)
    cefr: Literal["A1", "A2", "B1", "B2", "C1", "C2"] | None = None
    bkt: BKTSpec = BKTSpec()
    explanation: str = ""  # filled from kcs/<id>.md


class Misconception(_Strict):
    answer: str = Field(min_length=1)
    diagnosis: str = Field(min_length=1)


class Problem(_Strict):
    id: str = Field(pattern=_ID)
    kcs: list[str] = Field(min_length=1)
    text: str = Field(min_length=1)
    answer: str = Field(min_length=1)
    answer_type: Literal["numeric", "text"] = "numeric"
    accept: list[str] = []
    hints: list[str] = Field(min_length=2, max_length=2)
    correction: str = Field(min_length=1)
    misconceptions: list[Misconception] = []

    @cached_property
    def answer_forms(self) -> list[str]:
        return [self.answer, *self.accept]

    def view(self) -> dict[str, Any]:
        """What a student is shown of the problem (never its answer)."""
        return {"id": self.id, "text": self.text, "kcs": self.kcs}


class Course(_Strict):
    id: str = Field(pattern=_ID)
    title: str = Field(min_length=1)
    subject: Literal["math", "language"]
    description: str = ""
    persona: str = Field(min_length=1)
    kcs: list[KC] = Field(min_length=1)
    problems: list[Problem] = []

    @field_validator("kcs", "problems")
    @classmethod
    def _unique_ids(
        cls, items: list[KC] | list[Problem], info: ValidationInfo
    ) -> list[KC] | list[Problem]:
        _no_duplicates([i.id for i in items], {"kcs": "KC", "problems": "problem"}[info.field_name])
        return items

    @cached_property
    def kc(self) -> dict[str, KC]:
        return {k.id: k for k in self.kcs}

    @cached_property
    def problem(self) -> dict[str, Problem]:
        return {p.id: p for p in self.problems}

    @property
    def has_cefr(self) -> bool:
        return any(k.cefr for k in self.kcs)


def _no_duplicates(ids: list[str], what: str) -> None:
    seen: set[str] = set()
    for i in ids:
        if i in seen:
            raise ValueError(f"duplicate {what} id {i!r}")
        seen.add(i)


def _yaml(path: Path) -> object:
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        return yaml.safe_load(path.read_text("utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML: {e}") from e


def load_course(folder: str | Path) -> Course:
    """The course in `folder`, checked; ValueError naming the file and field otherwise."""
    folder = Path(folder)
    meta = _yaml(folder / "course.yaml")
    problems = _yaml(folder / "problems.yaml")
    if not isinstance(meta, dict):
        raise ValueError(f"{folder / 'course.yaml'} must be a mapping")
    if not isinstance(problems, list):
        raise ValueError(f"{folder / 'problems.yaml'} must be a list of problems")
    meta.setdefault("id", folder.name)
    for kc in meta.get("kcs") or []:
        md = folder / "kcs" / f"{kc.get('id')}.md" if isinstance(kc, dict) else None
        if md is not None and md.is_file():
            kc["explanation"] = md.read_text("utf-8").strip()
    try:
        course = Course.model_validate({**meta, "problems": problems})
    except ValidationError as e:
        raise ValueError(f"course {folder}: {e}") from e
    _check(course, folder)
    return course


def _check(course: Course, folder: Path) -> None:
    if not course.problems:
        raise ValueError(f"{folder / 'problems.yaml'} has no problems")
    for kc in course.kcs:
        if not kc.explanation:
            raise ValueError(f"{folder / 'kcs' / (kc.id + '.md')} is missing or empty")
    for p in course.problems:
        if p.answer_type == "numeric":
            for form in p.answer_forms:
                if not offered_values(form):
                    raise ValueError(f"problem {p.id!r}: numeric answer {form!r} has no number")
        unknown = [k for k in p.kcs if k not in course.kc]
        if unknown:
            raise ValueError(f"problem {p.id!r} names unknown KC(s) {unknown}")
        for level, hint in enumerate(p.hints, 1):
            if leaks_answer(hint, p):
                raise ValueError(
                    f"problem {p.id!r}: the level-{level} hint gives the answer away: {hint!r}"
                )


def load_courses(extra: list[str | Path] = ()) -> dict[str, Course]:
    """The built-in courses plus every course folder in `extra` (a course or a folder of them)."""
    folders = sorted(p for p in BUILTIN.iterdir() if (p / "course.yaml").is_file())
    for root in map(Path, extra):
        if (root / "course.yaml").is_file():
            folders.append(root)
        elif root.is_dir():
            folders += sorted(p for p in root.iterdir() if (p / "course.yaml").is_file())
        else:
            raise ValueError(f"course folder {root} does not exist")
    courses: dict[str, Course] = {}
    for folder in folders:
        course = load_course(folder)
        if course.id in courses:
            log.warning("course %r in %s replaces an earlier one", course.id, folder)
        courses[course.id] = course
    return courses
