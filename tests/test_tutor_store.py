"""TutorStore: everything written comes back (also after a restart), turn indices stay
contiguous under concurrent writers, foreign keys hold, and bad URLs fail clearly — on SQLite
and on a real PostgreSQL server (a throwaway one from Debian's package, started here)."""

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import uuid
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from tutorserve.tutor.store import Attempt, KCState, TutorStore, default_url

DIAGNOSIS = {"kind": "slip", "kcs": ["fractions.add"], "confidence": 0.7, "nested": {"a": [1, 2]}}


@pytest.fixture(scope="module")
def postgres():
    """A PostgreSQL server on a free loopback port for this module; yields its admin URL."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb")) or [shutil.which("initdb")]
    if not found[-1]:
        pytest.fail("PostgreSQL's initdb is missing; install Debian's postgresql (make test does)")
    bindir = os.path.dirname(found[-1])
    base = tempfile.mkdtemp(prefix="tutor-pg-")
    # PostgreSQL refuses to run as root; as root, run it as Debian's postgres user.
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(base, "postgres")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = os.path.join(base, "data")

    def run(*cmd: str) -> None:
        subprocess.run([*as_user, *cmd], check=True, capture_output=True)

    run(f"{bindir}/initdb", "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8")
    opts = f"-p {port} -k {base} -h 127.0.0.1"
    run(f"{bindir}/pg_ctl", "-D", data, "-o", opts, "-l", f"{base}/log", "-w", "start")
    try:
        yield f"postgresql+psycopg://postgres@127.0.0.1:{port}"
    finally:
        run(f"{bindir}/pg_ctl", "-D", data, "-m", "immediate", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'tutor.db'}"
    admin = request.getfixturevalue("postgres")
    name = f"t_{uuid.uuid4().hex}"
    engine = sa.create_engine(f"{admin}/postgres", isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    engine.dispose()
    return f"{admin}/{name}"


def fill(store: TutorStore) -> str:
    """Write one of everything; returns the session id."""
    store.ensure_learner("ann")
    first = store.create_session("ann", "algebra", "p1")
    changes = Attempt({}, {"fractions.add": 0.1}, False, None)  # type: ignore[dict-item]
    store.add_turn(first.id, "hi", "hello", DIAGNOSIS, 2, {"ms": 12.5}, changes)
    store.add_turn(first.id, "3/4?", "close", {}, 0, {"ms": 3})
    store.set_engage(first.id, 1, "try again")
    store.set_problem(first.id, "p2")
    store.save_mastery("ann", "algebra", {"k1": KCState(0.4, 3, 1, 1), "k2": KCState(0.9)})
    store.mark_solved("ann", "algebra", "p1")
    store.mark_solved("ann", "algebra", "p1")  # idempotent
    store.mark_solved("ann", "geometry", "g7")
    return first.id


def snapshot(store: TutorStore, session_id: str) -> tuple:
    return (
        store.get_session(session_id),
        store.sessions_of("ann"),
        store.turns(session_id),
        store.mastery("ann", "algebra"),
        store.solved("ann", "algebra"),
        store.solved("ann", "geometry"),
    )


def test_round_trip(db_url):
    store = TutorStore(db_url)
    before = datetime.now(UTC)
    sid = fill(store)
    later = [store.create_session("ann", "geometry", None) for _ in range(5)]
    second = later[0]

    session = store.get_session(sid)
    assert (session.learner_id, session.course_id, session.problem_id) == ("ann", "algebra", "p2")
    assert session.num_turns == 2
    assert session.created_at.tzinfo is not None
    assert before <= session.created_at <= second.created_at
    # Six sessions: random ids would come back in creation order by chance 1 time in 720.
    assert [s.id for s in store.sessions_of("ann")] == [sid] + [s.id for s in later]
    assert store.get_session(second.id).num_turns == 0
    assert store.sessions_of("nobody") == []

    turns = store.turns(sid)
    assert [(t.index, t.message, t.reply, t.engage) for t in turns] == [
        (0, "hi", "hello", None),
        (1, "3/4?", "close", "try again"),
    ]
    assert turns[0].diagnosis == DIAGNOSIS
    assert turns[0].mastery_changes == {"fractions.add": 0.1}
    assert (turns[0].timing, turns[0].ladder_level) == ({"ms": 12.5}, 2)
    assert turns[0].created_at.tzinfo is not None and turns[0].created_at <= turns[1].created_at

    assert store.mastery("ann", "algebra") == {"k1": KCState(0.4, 3, 1, 1), "k2": KCState(0.9)}
    assert store.mastery("ann", "geometry") == {}
    assert store.solved("ann", "algebra") == {"p1"}
    assert store.solved("ann", "geometry") == {"g7"}
    assert store.solved("bob", "algebra") == set()
    store.close()


def test_restart_reads_everything_back(db_url):
    url = db_url
    store = TutorStore(url)
    sid = fill(store)
    written = snapshot(store, sid)
    store.close()

    reopened = TutorStore(url)
    assert snapshot(reopened, sid) == written
    assert written[0].problem_id == "p2" and len(written[2]) == 2
    # The next turn continues the numbering from the file.
    assert reopened.add_turn(sid, "again", "ok", {}, 1, {}) == 2
    reopened.close()


def test_turn_indices_contiguous_under_threads(db_url):
    store = TutorStore(db_url)
    sid = store.create_session("ann", "algebra", None).id
    assert [store.add_turn(sid, str(i), "r", {}, 0, {}) for i in range(3)] == [0, 1, 2]

    per_thread = 5
    got: list[int] = []
    barrier = threading.Barrier(8)

    def worker(w: int) -> None:
        barrier.wait()
        for i in range(per_thread):
            got.append(store.add_turn(sid, f"{w}.{i}", "r", {"w": w}, 0, {}))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    total = 3 + 8 * per_thread
    assert sorted(got) == list(range(3, total))
    turns = store.turns(sid)
    assert [t.index for t in turns] == list(range(total))
    # Each index holds the message its add_turn call wrote, once.
    assert len({t.message for t in turns}) == total
    assert store.get_session(sid).num_turns == total
    store.close()


def test_unknown_session_and_foreign_keys(db_url):
    store = TutorStore(db_url)
    assert store.get_session("nope") is None
    with pytest.raises(KeyError):
        store.add_turn("nope", "m", "r", {}, 0, {})
    with pytest.raises(KeyError):
        store.set_problem("nope", "p1")
    with pytest.raises(KeyError):
        store.set_engage("nope", 0, "x")
    assert store.turns("nope") == []

    assert not store.learner_exists("zed")
    store.create_session("zed", "algebra", None)
    assert store.learner_exists("zed")
    store.ensure_learner("zed")  # idempotent
    assert store.learner_exists("zed")

    # The database itself refuses rows pointing at missing parents.
    now = datetime.now(UTC).isoformat()
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO sessions (id, learner_id, course_id, created_at)"
                " VALUES ('s1', 'ghost', 'algebra', :t)"
            ),
            {"t": now},
        )
    with pytest.raises(sa.exc.IntegrityError), store.engine.begin() as conn:
        conn.execute(
            sa.text(
                'INSERT INTO turns (session_id, "index", message, reply, diagnosis, ladder_level,'
                " mastery_changes, timing, created_at) VALUES ('ghost', 0, 'm', 'r', '{}', 0,"
                " '{}', '{}', :t)"
            ),
            {"t": now},
        )
    store.close()


def test_save_mastery_upserts(db_url):
    store = TutorStore(db_url)
    store.save_mastery("ann", "algebra", {"k1": KCState(0.2), "k2": KCState(0.5, 1, 1, 1)})
    store.save_mastery("ann", "algebra", {"k1": KCState(0.6, 2, 0, 0)})
    store.save_mastery("ann", "geometry", {"k1": KCState(0.1)})
    assert store.mastery("ann", "algebra") == {
        "k1": KCState(0.6, 2, 0, 0),
        "k2": KCState(0.5, 1, 1, 1),
    }
    assert store.mastery("ann", "geometry") == {"k1": KCState(0.1)}
    with store.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT count(*) FROM mastery")).scalar_one()
    assert rows == 3
    store.close()


def test_default_url(tmp_path, monkeypatch):
    url = default_url(tmp_path / "data")
    assert url == f"sqlite:///{tmp_path / 'data' / 'tutor.db'}"
    store = TutorStore(url)
    sid = store.create_session("ann", "algebra", None).id
    store.close()
    assert (tmp_path / "data" / "tutor.db").is_file()
    assert TutorStore(url).get_session(sid) is not None

    monkeypatch.setenv("TUTORSERVE_DATA_DIR", str(tmp_path / "env"))
    assert default_url() == f"sqlite:///{tmp_path / 'env' / 'tutor.db'}"
    assert (tmp_path / "env").is_dir()
    TutorStore().close()
    assert (tmp_path / "env" / "tutor.db").is_file()


@pytest.mark.parametrize(
    "make_url",
    [
        lambda tmp: "nonsense://x",
        lambda tmp: "not a url",
        # A regular file stands where the folder would have to be created.
        lambda tmp: f"sqlite:///{tmp / 'file'}/sub/tutor.db",
    ],
)
def test_invalid_url_raises_value_error(tmp_path, make_url):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="cannot open tutor store"):
        TutorStore(make_url(tmp_path))


def test_a_turn_and_what_its_attempt_changed_are_one_transaction(db_url):
    store = TutorStore(db_url)
    sid = store.create_session("ann", "algebra", "p1").id
    solved = Attempt({"k1": KCState(0.8, 1)}, {"k1": {"before": 0.2, "after": 0.8}}, True, "p2")
    assert store.add_turn(sid, "4", "Correct!", {"correct": True}, 0, {}, solved) == 0
    assert store.mastery("ann", "algebra") == {"k1": KCState(0.8, 1)}
    assert store.solved("ann", "algebra") == {"p1"}
    assert store.get_session(sid).problem_id == "p2"
    assert store.turns(sid)[0].mastery_changes == solved.mastery_changes

    # A mastery row the database refuses takes the turn with it: nothing half-written.
    bad = Attempt({"k1": KCState(None)}, {}, True, "p3")  # type: ignore[arg-type]
    with pytest.raises(sa.exc.IntegrityError):
        store.add_turn(sid, "5", "Correct!", {"correct": True}, 0, {}, bad)
    assert len(store.turns(sid)) == 1 and store.get_session(sid).problem_id == "p2"
    assert store.mastery("ann", "algebra") == {"k1": KCState(0.8, 1)}
    store.close()
