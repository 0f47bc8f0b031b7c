"""A naive OpenAI-compatible completions server on plain `transformers`: a benchmark peer.

This is deliberately the way many tutoring prototypes start, not a tuned server: one worker
thread takes requests from a FIFO queue and calls `model.generate`. With `--batch-size 1` (the
default) requests run one at a time in arrival order. With `--batch-size N` it does static
batching: the worker waits up to `--batch-wait-ms` for more requests, left-pads up to N of them
(sharing one sampling config: temperature, top_p, ignore_eos) and runs one `generate`; the batch
holds its slots until its longest member is done. Tokens still stream as they are generated.

Serves `GET /health`, `GET /v1/models` and `POST /v1/completions` (a string `prompt`;
`max_tokens`, `temperature` (0: greedy), `top_p`, `stream`, `stream_options.include_usage` and
vLLM's `ignore_eos`). Client disconnects are ignored: an abandoned request runs to its end.
Run with the project venv's python:
    python src/tutorserve/bench/peers/transformers_server.py --model HF_DIR \
        --served-model-name NAME --port P
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers imports huggingface_hub

import torch
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.generation.streamers import BaseStreamer

log = logging.getLogger("transformers_server")

Item = int | str | BaseException  # a token id, then a finish reason, or the error that ended it


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    ignore_eos: bool
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue[Item] = field(default_factory=asyncio.Queue)
    n_out: int = 0
    finished: bool = False

    @property
    def key(self) -> tuple[float, float, bool]:
        """What a batch must share: one `generate` call takes one sampling config."""
        return self.temperature, self.top_p, self.ignore_eos

    def send(self, item: Item) -> None:
        """Thread-safe: hand an item to the job's request handler on the event loop."""
        self.finished = self.finished or not isinstance(item, int)
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class RowStreamer(BaseStreamer):
    """Routes each row of the batch's new token column to its job, until the row is done."""

    def __init__(self, batch: list[Job], eos_ids: set[int]) -> None:
        self.batch, self.eos_ids, self.prompt_seen = batch, eos_ids, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate first puts the (padded) prompt ids
            self.prompt_seen = True
            return
        for job, tok in zip(self.batch, value.reshape(-1).tolist(), strict=True):
            if job.finished:
                continue
            job.n_out += 1
            job.send(tok)
            if tok in self.eos_ids and not job.ignore_eos:
                job.send("stop")
            elif job.n_out >= job.max_tokens:
                job.send("length")

    def end(self) -> None:
        for job in self.batch:
            if not job.finished:
                job.send("length")


class RowBudget(StoppingCriteria):
    """Marks a row done once it has its own max_tokens (generate stops when all rows are done)."""

    def __init__(self, batch: list[Job], prompt_width: int) -> None:
        self.budget = torch.tensor([job.max_tokens for job in batch])
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.Tensor, scores: object, **kwargs: object) -> torch.Tensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.budget.to(input_ids.device)


class Worker(threading.Thread):
    """The one thread that runs the model: takes jobs in FIFO order, one `generate` per batch."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        batch_size: int,
        wait_s: float,
    ) -> None:
        super().__init__(daemon=True, name="generate-worker")
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.wait_s = batch_size, wait_s
        self.inbox: queue.Queue[Job] = queue.Queue()
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.pad_id = tokenizer.pad_token_id
        if self.pad_id is None:
            self.pad_id = min(self.eos_ids) if self.eos_ids else 0

    def run(self) -> None:
        pending: deque[Job] = deque()
        while True:
            if not pending:
                pending.append(self.inbox.get())
            deadline = time.monotonic() + self.wait_s
            while len(pending) < self.batch_size:
                try:
                    pending.append(self.inbox.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            # the oldest job and the next ones (in order) that can share its sampling config
            batch = [job for job in pending if job.key == pending[0].key][: self.batch_size]
            for job in batch:
                pending.remove(job)
            try:
                self.generate(batch)
            except Exception as e:
                log.exception("generate failed")
                for job in batch:
                    if not job.finished:
                        job.send(e)

    @torch.inference_mode()
    def generate(self, batch: list[Job]) -> None:
        t0 = time.perf_counter()
        width = max(len(job.prompt_ids) for job in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, job in enumerate(batch):  # left padding
            ids[i, width - len(job.prompt_ids) :] = torch.tensor(job.prompt_ids)
            mask[i, width - len(job.prompt_ids) :] = 1
        head, max_new = batch[0], max(job.max_tokens for job in batch)
        sampling: dict[str, object] = {"do_sample": False}
        if head.temperature > 0:  # top_k=0, or transformers applies its default top_k=50
            sampling = dict(do_sample=True, temperature=head.temperature, top_p=head.top_p, top_k=0)
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            min_new_tokens=max_new if head.ignore_eos else None,
            pad_token_id=self.pad_id,
            streamer=RowStreamer(batch, self.eos_ids),
            stopping_criteria=StoppingCriteriaList([RowBudget(batch, width)]),
            **sampling,
        )
        n, dt = sum(job.n_out for job in batch), time.perf_counter() - t0
        msg = "batch of %d (prompt width %d): %d tokens in %.2fs, %.1f tok/s; %d queued"
        log.info(msg, len(batch), width, n, dt, n / dt, self.inbox.qsize())


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionRequest(BaseModel):  # unknown fields are ignored
    model: str | None = None
    prompt: str = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)
    temperature: float | None = Field(default=1.0, ge=0.0)
    top_p: float | None = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


def _error(status: int, message: str, code: str | None = None) -> JSONResponse:
    body = {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    return JSONResponse({"error": body}, status_code=status)


def _sse(obj: object) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def build_app(worker: Worker, name: str, max_len: int | None) -> FastAPI:
    app, tok = FastAPI(title="naive transformers server"), worker.tokenizer

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: object, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "; ".join(f"{e['loc'][-1]}: {e['msg']}" for e in exc.errors()))

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        card = {"id": name, "object": "model", "created": 0, "owned_by": "transformers"}
        return {"object": "list", "data": [card | {"max_model_len": max_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest) -> JSONResponse | StreamingResponse:
        if body.model is not None and body.model != name:
            return _error(404, f"The model `{body.model}` does not exist.", "model_not_found")
        ids, max_tokens = (
            tok(body.prompt, add_special_tokens=False).input_ids,
            body.max_tokens or 16,
        )
        if max_len is not None and len(ids) + max_tokens > max_len:
            msg = f"{len(ids)} prompt + {max_tokens} new tokens exceed {max_len}"
            return _error(400, msg, "context_length_exceeded")
        t = 1.0 if body.temperature is None else body.temperature
        loop = asyncio.get_running_loop()
        job = Job(ids, max_tokens, t, body.top_p or 1.0, body.ignore_eos, loop)
        worker.inbox.put(job)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
        head |= {"created": int(time.time()), "model": name}

        def chunk(text: str, finish: str | None) -> dict[str, object]:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            return head | {"choices": [choice]}

        def usage() -> dict[str, int]:
            p, c = len(ids), job.n_out
            return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

        if not body.stream:
            out: list[int] = []
            while isinstance(item := await job.out.get(), int):
                out.append(item)
            if isinstance(item, BaseException):
                return _error(500, f"generation failed: {item!r}")
            text = tok.decode(out, skip_special_tokens=True)
            return JSONResponse(chunk(text, item) | {"usage": usage()})

        async def events() -> AsyncIterator[str]:
            out: list[int] = []
            sent = 0  # characters of the decoded output already streamed
            while isinstance(item := await job.out.get(), int):
                out.append(item)
                text = tok.decode(out, skip_special_tokens=True)
                if len(text) > sent and not text.endswith("\ufffd"):  # hold split UTF-8 bytes
                    yield _sse(chunk(text[sent:], None))
                    sent = len(text)
            if isinstance(item, BaseException):
                yield _sse({"error": {"message": f"generation failed: {item!r}"}})
                return
            yield _sse(chunk(tok.decode(out, skip_special_tokens=True)[sent:], item))
            if body.stream_options and body.stream_options.include_usage:
                yield _sse(head | {"choices": [], "usage": usage()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF-format model directory")
    p.add_argument("--served-model-name", default=None, help="model id clients send")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="bfloat16", help="bfloat16, float16, float32 or auto")
    p.add_argument("--batch-size", type=int, default=1, help="static batch size (1: no batching)")
    p.add_argument("--batch-wait-ms", type=float, default=50.0, help="wait to fill a batch")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    log.info("loading %s (%s), torch threads %d", args.model, args.dtype, torch.get_num_threads())
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, local_files_only=True)
    model.eval()
    wait_s = args.batch_wait_ms / 1000 if args.batch_size > 1 else 0.0
    worker = Worker(model, tokenizer, max(1, args.batch_size), wait_s)
    worker.start()
    max_len = getattr(model.config, "max_position_embeddings", None)
    app = build_app(worker, args.served_model_name or args.model, max_len)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
