"""`bench compare --kill-replica-after`: which processes are engine replicas, and the kill."""

import subprocess
import time

from tutorserve.bench.faults import ReplicaKill, replica_pids

TITLE = "ray::ServeReplica:tutorserve:engine"


def test_engine_replicas_are_found_by_their_process_title(tmp_path):
    titles = {
        "11": TITLE, "12": "ray::ServeReplica:tutorserve:decode", "13": "ray::ServeController",
        "14": "ray::ServeReplica:tutorserve-prefill:prefill", "15": "python -m tutorserve.cli",
        "self": TITLE,
    }  # fmt: skip
    for pid, title in titles.items():
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(title.encode() + b"\0")
    (tmp_path / "16").mkdir()  # a process that went away: no cmdline
    assert replica_pids(tmp_path) == [11, 12]


def test_the_kill_happens_after_its_delay_and_is_reported():
    victim = subprocess.Popen(["bash", "-c", f"exec -a '{TITLE}' sleep 60"])
    try:
        kill = ReplicaKill(0.3, find=lambda: [victim.pid])
        kill.start()
        time.sleep(0.1)
        assert victim.poll() is None  # not before its time
        assert victim.wait(timeout=10) == -9
        report = kill.stop()
        assert report["killed_pid"] == victim.pid and report["killed_at_s"] >= 0.3
    finally:
        victim.kill()


def test_a_run_without_replicas_gets_no_fault():
    kill = ReplicaKill(0.0, find=list)
    kill.start()
    time.sleep(0.2)
    assert kill.stop() == {"kill_replica_after_s": 0.0, "killed_pid": None, "killed_at_s": None}
