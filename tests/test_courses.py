"""The built-in courses load, every problem's answers and misconceptions are judged the way the
author meant, and the loader rejects the mistakes an author can make, saying where."""

from pathlib import Path

import pytest
import yaml

from tutorserve.tutor.answers import is_correct, leaks_answer
from tutorserve.tutor.courses import load_course, load_courses

COURSES = load_courses()
PROBLEMS = [(c.id, p.id) for c in COURSES.values() for p in c.problems]


def _problem(course_id: str, problem_id: str):
    return COURSES[course_id].problem[problem_id]


def test_builtin_courses_load():
    assert {"algebra", "english-b1"} <= set(COURSES)
    algebra, english = COURSES["algebra"], COURSES["english-b1"]
    assert algebra.subject == "math" and english.subject == "language"
    assert all(k.cefr for k in english.kcs) and not algebra.has_cefr
    for course in (algebra, english):
        assert len(course.kcs) >= 5
        assert 12 <= len(course.problems) <= 14
        # Every KC is practised by at least two problems.
        for kc in course.kcs:
            assert sum(kc.id in p.kcs for p in course.problems) >= 2, kc.id


def test_first_algebra_problem_is_the_easy_factoring_one():
    first = COURSES["algebra"].problems[0]
    assert "factoring" in first.kcs
    assert is_correct("x = 2 or x = 3", first)
    assert not is_correct("x = -2 or x = -3", first)


@pytest.mark.parametrize(("course_id", "problem_id"), PROBLEMS)
def test_answer_and_accepted_forms_are_correct(course_id, problem_id):
    p = _problem(course_id, problem_id)
    for form in p.answer_forms:
        assert is_correct(form, p), form


@pytest.mark.parametrize(("course_id", "problem_id"), PROBLEMS)
def test_misconceptions_are_wrong(course_id, problem_id):
    p = _problem(course_id, problem_id)
    assert p.misconceptions, "every problem names at least one typical wrong answer"
    for m in p.misconceptions:
        assert not is_correct(m.answer, p), m.answer


@pytest.mark.parametrize(("course_id", "problem_id"), PROBLEMS)
def test_correction_states_the_answer_and_hints_do_not(course_id, problem_id):
    p = _problem(course_id, problem_id)
    assert leaks_answer(p.correction, p), p.correction
    for hint in p.hints:
        assert not leaks_answer(hint, p), hint


@pytest.mark.parametrize(("course_id", "problem_id"), PROBLEMS)
def test_text_problems_have_one_gap(course_id, problem_id):
    p = _problem(course_id, problem_id)
    if p.answer_type == "text":
        assert p.text.count("___") == 1


# Loader error cases on a small course written to tmp_path.


def _write_course(folder: Path, meta: dict, problems: list, kc_files: dict[str, str]) -> Path:
    (folder / "kcs").mkdir(parents=True)
    (folder / "course.yaml").write_text(yaml.safe_dump(meta), "utf-8")
    (folder / "problems.yaml").write_text(yaml.safe_dump(problems), "utf-8")
    for kc_id, text in kc_files.items():
        (folder / "kcs" / f"{kc_id}.md").write_text(text, "utf-8")
    return folder


def _meta() -> dict:
    return {
        "id": "mini",
        "title": "Mini course",
        "subject": "math",
        "persona": "You are a patient tutor.",
        "kcs": [{"id": "linear", "name": "Linear equations"}],
    }


def _problem_dict(**changes) -> dict:
    p = {
        "id": "p1",
        "kcs": ["linear"],
        "text": "Solve 2x + 1 = 9.",
        "answer": "4",
        "hints": ["Undo the addition first.", "What is 2x after subtracting 1 from both sides?"],
        "correction": "2x = 8, so x = 4.",
    }
    return {**p, **changes}


def _mini(tmp_path: Path, problems=None, kc_files=None) -> Path:
    return _write_course(
        tmp_path / "mini",
        _meta(),
        [_problem_dict()] if problems is None else problems,
        {"linear": "Do the same to both sides."} if kc_files is None else kc_files,
    )


def test_mini_course_loads(tmp_path):
    course = load_course(_mini(tmp_path))
    assert course.id == "mini"
    assert course.kc["linear"].explanation == "Do the same to both sides."
    assert course.problem["p1"].answer == "4"
    assert "mini" in load_courses([tmp_path])


def test_unknown_kc_is_named(tmp_path):
    folder = _mini(tmp_path, problems=[_problem_dict(kcs=["linear", "quadratics"])])
    with pytest.raises(ValueError, match=r"'p1'.*quadratics"):
        load_course(folder)


def test_missing_kc_explanation_names_the_file(tmp_path):
    folder = _mini(tmp_path, kc_files={})
    with pytest.raises(ValueError, match="is missing") as e:
        load_course(folder)
    assert str(folder / "kcs" / "linear.md") in str(e.value)


def test_level_1_hint_with_the_answer_is_rejected(tmp_path):
    hints = ["The answer is 4.", "What is 2x after subtracting 1?"]
    folder = _mini(tmp_path, problems=[_problem_dict(hints=hints)])
    with pytest.raises(ValueError, match="level-1 hint gives the answer away"):
        load_course(folder)


def test_text_hint_with_the_word_is_rejected(tmp_path):
    problem = _problem_dict(
        text="Yesterday we ___ (watch) a film.",
        answer="watched",
        answer_type="text",
        hints=["Use the past simple.", "Is it watched or watch?"],
        correction="We watched a film.",
    )
    folder = _mini(tmp_path, problems=[problem])
    with pytest.raises(ValueError, match="level-2 hint gives the answer away"):
        load_course(folder)


@pytest.mark.parametrize("name", ["course.yaml", "problems.yaml"])
def test_invalid_yaml_is_rejected(tmp_path, name):
    folder = _mini(tmp_path)
    (folder / name).write_text("id: [unclosed\n  - : :\n", "utf-8")
    with pytest.raises(ValueError, match="not valid YAML") as e:
        load_course(folder)
    assert name in str(e.value)


def test_duplicate_problem_id_is_rejected(tmp_path):
    folder = _mini(tmp_path, problems=[_problem_dict(), _problem_dict()])
    with pytest.raises(ValueError, match="duplicate problem id 'p1'"):
        load_course(folder)
