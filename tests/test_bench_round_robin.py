"""The round-robin proxy peer (`bench/peers/round_robin.py`) in front of two fake upstreams."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from tutorserve.bench.client import scrape_counters
from tutorserve.bench.offline import PEERS_DIR

# Says which copy it is in every answer, counts a prefix cache of its own, streams five pieces
# 50 ms apart (so that a proxy that buffers shows it), and is not ready while a file says so.
FAKE = textwrap.dedent("""
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    NAME, I = os.environ["FAKE_NAME"], int(os.environ["FAKE_I"])
    DIR = sys.argv[2]
    open(os.path.join(DIR, f"pid-{I}"), "w").write(str(os.getpid()))

    class H(BaseHTTPRequestHandler):
        def reply(self, body, ctype="application/json", status=200):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/metrics":
                self.reply((f"# TYPE fake:prefix_cache_queries counter\\n"
                            f"fake:prefix_cache_queries_total {100 * (I + 1)}\\n"
                            f"# TYPE fake:prefix_cache_hits counter\\n"
                            f"fake:prefix_cache_hits_total {30 + 10 * I}\\n").encode(),
                           "text/plain")
            elif os.path.exists(os.path.join(DIR, f"sick-{I}")):
                self.reply(b'{"error": "not ready"}', status=503)
            else:
                self.reply(json.dumps({"data": [{"id": "m"}], "from": NAME}).encode())

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.protocol_version = "HTTP/1.0"  # the body ends when the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for k in range(5):
                piece = {"choices": [{"text": f"{NAME}:{k} "}]}
                self.wfile.write(f"data: {json.dumps(piece)}\\n\\n".encode())
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"data: [DONE]\\n\\n")

        def log_message(self, *args):
            pass

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def proxy(tmp_path):
    (tmp_path / "fake.py").write_text(FAKE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, str(PEERS_DIR / "round_robin.py"), "--port", str(port),
            "--replicas", "2", "--replica-env", "FAKE_NAME=copy-{i}", "--replica-env",
            "FAKE_I={i}", "--", sys.executable, str(tmp_path / "fake.py"), "{port}",
            str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        assert proc.poll() is None, "the proxy exited at start-up"
        assert time.monotonic() < deadline, "the proxy never became healthy"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pids = [int((tmp_path / f"pid-{i}").read_text()) for i in range(2)]
    yield proc, url, pids, tmp_path
    proc.kill()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def stream(url: str) -> tuple[list[str], list[float]]:
    """The completion's text pieces, and when each chunk of bytes arrived."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": True}
    texts, times = [], []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = b""
        for chunk in r.iter_raw():
            times.append(time.monotonic())
            buf += chunk
    for event in buf.decode().split("\n\n"):
        if event.startswith("data: {"):
            texts.append(httpx.Response(200, content=event[6:]).json()["choices"][0]["text"])
    return texts, times


def test_round_robin_streams_sums_metrics_and_stops_its_copies(proxy):
    proc, url, pids, tmp_path = proxy
    firsts = []
    for _ in range(4):
        texts, times = stream(url)
        who = texts[0].split(":")[0]
        assert texts == [f"{who}:{k} " for k in range(5)]  # every piece, in order
        # Passed on as produced: the pieces come 50 ms apart, so a buffering proxy would
        # deliver them all at once.
        assert len(times) >= 3 and times[-1] - times[0] > 0.15
        firsts.append(who)
    assert firsts in (["copy-0", "copy-1"] * 2, ["copy-1", "copy-0"] * 2)

    models = httpx.get(url + "/v1/models", timeout=5)
    assert models.status_code == 200 and models.json()["data"] == [{"id": "m"}]
    assert scrape_counters(url) == {
        "prefix_cache_queries_total": 100.0 + 200.0,
        "prefix_cache_hits_total": 30.0 + 40.0,
    }
    (tmp_path / "sick-1").touch()  # one copy not ready: neither is the cluster
    assert httpx.get(url + "/health", timeout=5).status_code == 503
    assert httpx.get(url + "/v1/models", timeout=5).status_code == 503

    assert all(alive(pid) for pid in pids)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=15)
    deadline = time.monotonic() + 5
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)
