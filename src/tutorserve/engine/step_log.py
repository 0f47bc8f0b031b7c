"""The engine's step log: each step's shape and wall time, kept in memory (benchmarks, profiling)
or written as JSON lines (`--step-log-dir`), so that the step-cost model can be calibrated on the
steps an engine ran inside a server (`bench calibrate --from-step-logs`), where the serving path
and other replicas share its cores, and not only on an engine alone.

A log file's first line is a header (the settings a step-cost model records, and the tokens per
step above which the weights are dequantized); each further line is one step. Logs kept for later
may be gzipped (`steps-*.jsonl.gz`).
"""

from __future__ import annotations

import gzip
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from tutorserve.engine.scheduler import StepShape

log = logging.getLogger(__name__)
_ENGINES = itertools.count()  # engines of this process that opened a log


@dataclass(slots=True)
class StepRecord:
    num_seqs: int
    num_tokens: int
    all_decode: bool
    step_s: float
    forward_s: float  # model forward + logits; the rest of step_s is engine overhead
    num_running: int
    num_used_blocks: int
    shape: StepShape
    # Since the previous step ended with requests left (None: it left none, or is not known):
    # the time the loop around the engine (a server's) takes between two busy steps.
    gap_s: float | None = None
    # Wall-clock start (time.time()): lines up the steps of engines in other processes.
    started_at: float | None = None
    # Drafted tokens the step verified (counted in num_tokens): a step whose tokens exceed its
    # rows plus these computes a prompt.
    num_draft_tokens: int = 0

    @property
    def prefills(self) -> bool:
        return self.num_tokens > self.num_seqs + self.num_draft_tokens


class LoggedStep(NamedTuple):
    shape: StepShape
    seconds: float
    gap_s: float | None
    started_at: float | None  # None: logged before starts were (2026-12-05)
    engine: int  # which log file, in the order read


class StepLogFile:
    """Writes each step to DIR/steps-<pid>-<n>.jsonl: one file per engine, so replicas sharing a
    folder (or engines sharing a process) do not interleave. Line-buffered, so a server stopped
    by a signal keeps every step."""

    def __init__(self, folder: str | Path, header: dict[str, Any]) -> None:
        folder = Path(folder).expanduser()
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"steps-{os.getpid()}-{next(_ENGINES)}.jsonl"
        self._file = self.path.open("w", buffering=1)
        self._file.write(json.dumps({"header": {**header, "date": time.strftime("%Y-%m-%d %H:%M")}})
                         + "\n")  # fmt: skip

    def append(self, record: StepRecord) -> None:
        shape = asdict(record.shape)
        entry = {"shape": shape, "seconds": record.step_s, "gap": record.gap_s,
                 "start": record.started_at}  # fmt: skip
        self._file.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        self._file.close()


def read_step_logs(paths: Iterable[str | Path]) -> tuple[list[dict], list[LoggedStep]]:
    """The headers and the steps of step-log files (folders: every steps-*.jsonl and
    steps-*.jsonl.gz in them)."""
    files: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise ValueError(f"{p}: no such step log or folder")
        files += sorted(p.glob("steps-*.jsonl*")) if p.is_dir() else [p]
    if not files:
        raise ValueError("no step logs found (steps-*.jsonl, written by --step-log-dir)")
    headers, steps = [], []
    for engine, f in enumerate(files):
        data = f.read_bytes()
        try:
            lines = (gzip.decompress(data) if f.suffix == ".gz" else data).decode().splitlines()
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"{f}: not a step log ({e})") from None
        for n, line in enumerate(lines):
            try:
                entry = json.loads(line)
                if "header" in entry:
                    headers.append(entry["header"])
                    continue
                s = entry["shape"]
                rows = tuple((int(a), int(b)) for a, b in s["rows"])
                shape = StepShape(rows, int(s["num_adapters"]), int(s["lora_tokens"]))
                # Absent: logged before gaps and starts were (2026-12-05).
                gap, start = (entry.get(k) for k in ("gap", "start"))
                steps.append(LoggedStep(shape, float(entry["seconds"]), _number(gap),
                                        _number(start), engine))  # fmt: skip
            except (ValueError, KeyError, TypeError) as e:
                if n == len(lines) - 1:  # the engine was killed mid-line
                    log.warning("%s: last line cut short, skipped", f)
                    continue
                raise ValueError(f"{f}:{n + 1}: not a step-log line ({e})") from None
    return headers, steps


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
