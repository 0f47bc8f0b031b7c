"""`tutorserve bench calibrate`: measure the engine's steps on this host over a spread of batch
shapes and fit the step-cost model (`step_cost.py`) the simulator runs on.

Episodes are random but seeded: a batch size, a prompt length, whether prompts share a prefix
(so steps compute after cached tokens), how many tokens to decode, and whether requests arrive
all at once or in waves (so prefill chunks mix with decodes, as under serving load). Every
fourth episode is held out: the model's error is reported on steps it was not fitted on. With
`parallel` > 1, that many engines calibrate at once in separate processes, as replicas sharing
the host do (they contend for memory bandwidth, which one engine alone would not show).

`from_step_logs` fits the same model on the steps that engines ran inside a server instead
(`serve --step-log-dir`): there the serving path (HTTP, tokenizer, streaming) and the other
replicas share the engine's cores, which an engine calibrated alone does not see.
"""

from __future__ import annotations

import bisect
import logging
import random
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tutorserve.bench.step_cost import StepCostModel
from tutorserve.config import EngineConfig
from tutorserve.engine.scheduler import StepShape
from tutorserve.engine.step_log import LoggedStep, read_step_logs
from tutorserve.lora.synth import synth_lora
from tutorserve.models.loader import load_model_config
from tutorserve.quant.layers import dequantizing_rows
from tutorserve.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_BATCHES = (1, 2, 4, 8, 16, 32, 48)
_PROMPTS = (32, 128, 512, 1024, 1800)
_MAX_EPISODE_TOKENS = 4_000  # prompt tokens computed per episode (bounds its time)
# Tokens of its own after a shared prefix (a student's part after a course prompt): on both sides
# of the rows above which quantized weights are dequantized (`quant.layers.dequantizing_rows`),
# so that the fit sees what a short chunk costs either way.
_OWN_TOKENS = (16, 48, 96, 160)


@dataclass(frozen=True, slots=True)
class Episode:
    batch: int
    prompt: int
    own: int  # tokens of each prompt not shared with the others (all of it: none shared)
    max_tokens: int
    waves: int  # requests arrive in this many waves, 3 steps apart

    @classmethod
    def draw(cls, rng: random.Random) -> Episode:
        prompt = rng.choice(_PROMPTS)
        # Prompts sharing a prefix (a course prompt) compute only their own part after the
        # first: large batches over long contexts cost little to set up.
        own = min(rng.choice(_OWN_TOKENS), prompt // 2) if rng.random() < 0.5 else prompt
        batch = min(rng.choice(_BATCHES), max(1, _MAX_EPISODE_TOKENS // own))
        return cls(batch, prompt, own, rng.randint(8, 32), rng.choice((1, 1, 2, 4)))


@dataclass(slots=True)
class Sample:
    shape: StepShape
    seconds: float
    held_out: bool
    sibling_busy: bool = False  # it started while another replica of the host was stepping


def _run_episode(engine: Any, ep: Episode, rng: random.Random, tag: str) -> None:
    vocab = engine.model.config.vocab_size
    shared = [rng.randrange(100, vocab - 100) for _ in range(ep.prompt - ep.own)]
    prompts = [shared + [rng.randrange(100, vocab - 100) for _ in range(ep.own)]
               for _ in range(ep.batch)]  # fmt: skip
    params = SamplingParams(max_tokens=ep.max_tokens, ignore_eos=True)
    # With adapters loaded, half the episodes spread their requests over 1, 2 or all of them.
    names = engine.lora_names()
    mix = rng.choice([0, 1, 2, len(names)]) if names and rng.random() < 0.5 else 0
    per_wave = -(-ep.batch // ep.waves)
    step = 0
    while prompts or engine.has_unfinished():
        if prompts and step % 3 == 0:
            for ids in prompts[:per_wave]:
                lora = names[len(prompts) % mix] if mix else None
                engine.add_request(f"{tag}-{len(engine.seqs)}-{rng.random()}", ids, params,
                                   lora=lora)  # fmt: skip
            del prompts[:per_wave]
        engine.step()
        step += 1


def _restore_probe(engine: Any, rng: random.Random, history: int = 1024) -> Sample:
    """The step that admits a session's next turn with its history restored from the RAM tier
    (the pool's prefix cache emptied in between, as eviction would): its time less the
    model's prediction for what it computes is the copy."""
    vocab = engine.model.config.vocab_size
    ids = [rng.randrange(100, vocab - 100) for _ in range(history)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    tag = f"probe-{rng.random()}"
    engine.add_request(f"{tag}-a", ids, params, session_id=tag)
    while engine.has_unfinished():
        engine.step()
    engine.reset_prefix_cache()
    engine.step_log = []
    engine.add_request(f"{tag}-b", ids + ids[:16], params, session_id=tag)
    while engine.has_unfinished():
        engine.step()
    step, engine.step_log = engine.step_log[0], None
    return Sample(step.shape, step.step_s, held_out=True)


def measure(
    config: EngineConfig, episodes: int, seed: int, position: int = 0
) -> tuple[list[Sample], list[Sample], int | None]:
    """Steps of `episodes` random episodes on one engine built from `config`, the steps of
    three restores from the RAM tier, and the tokens per step above which its weights are
    dequantized."""
    from tutorserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    rng = random.Random(seed)
    _run_episode(engine, Episode(4, 256, 16, 8, 2), rng, "warmup")  # kernels built, caches hot
    samples: list[Sample] = []
    for i in tqdm(range(episodes), desc=f"calibrating (engine {position})", position=position):
        ep = Episode.draw(rng)
        engine.reset_prefix_cache()  # each episode's cached tokens are only its own
        engine.step_log = []
        _run_episode(engine, ep, rng, f"e{i}")
        samples += [Sample(r.shape, r.step_s, i % 4 == 3) for r in engine.step_log]
        engine.step_log = None
    probes = [_restore_probe(engine, rng) for _ in range(3)]
    engine.close()
    return samples, probes, dequantizing_rows(engine.model, engine.dtype)


def probe_restores(config: EngineConfig, seed: int) -> list[Sample]:
    """Three restores from the RAM tier on an engine built from `config` (with a RAM tier),
    for a model fitted on steps that had none (`from_step_logs`)."""
    from tutorserve.engine.engine import LLMEngine

    engine = LLMEngine(config)
    rng = random.Random(seed)
    _run_episode(engine, Episode(4, 256, 16, 8, 2), rng, "warmup")
    probes = [_restore_probe(engine, rng) for _ in range(3)]
    engine.close()
    return probes


def restore_cost(model: StepCostModel, probes: list[Sample], block_size: int) -> float:
    """Seconds per block restored: a probe's time less what the model says it computes, over
    its cached blocks (all from RAM: the pool was emptied)."""
    return statistics.median(max(0.0, p.seconds - model.step_seconds(p.shape))
                             / (p.shape.rows[0][1] // block_size) for p in probes)  # fmt: skip


def calibrate(
    config: EngineConfig, episodes: int, seed: int, parallel: int, source: str, loras: int = 0
) -> tuple[StepCostModel, list[Sample]]:
    """With `loras` > 0, that many random rank-16 adapters are loaded, and episodes mix them."""
    if episodes < 4 or parallel < 1 or loras < 0:
        raise ValueError("need --episodes >= 4 (every fourth is held out), --parallel >= 1 "
                         "and --loras >= 0")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="calibrate-loras-") as root:
        if loras:
            cfg = load_model_config(config.model)
            adapters = {f"a{i}": str(synth_lora(Path(root) / f"a{i}", cfg, 16, seed=i))
                        for i in range(loras)}  # fmt: skip
            config = replace(config, lora_modules=adapters, enable_lora=True, max_loras=loras)
        return _calibrate(config, episodes, seed, parallel, source)


def _calibrate(
    config: EngineConfig, episodes: int, seed: int, parallel: int, source: str
) -> tuple[StepCostModel, list[Sample]]:
    start = time.perf_counter()
    if parallel == 1:
        samples, probes, dequant_rows = measure(config, episodes, seed)
    else:
        with ProcessPoolExecutor(parallel, mp_context=get_context("spawn")) as pool:
            jobs = [pool.submit(measure, config, episodes, seed + k, k) for k in range(parallel)]
            runs = [j.result() for j in jobs]
        samples = [s for run in runs for s in run[0]]
        probes = [p for run in runs for p in run[1]]
        dequant_rows = runs[0][2]
    fit = [s for s in samples if not s.held_out]
    test = [s for s in samples if s.held_out]
    meta = {
        "model": config.model,
        "dtype": config.dtype,
        "threads": config.num_threads,
        "parallel_engines": parallel,
        "loras": len(config.lora_modules),
        "block_size": config.block_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "episodes": episodes,
        "seed": seed,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    model = StepCostModel.fit([s.shape for s in fit], [s.seconds for s in fit], dequant_rows,
                              source=source, meta=meta)  # fmt: skip
    model.error = model.held_out_error([s.shape for s in test], [s.seconds for s in test])
    model.restore_s_per_block = restore_cost(model, probes, config.block_size)
    return model, samples


_HELD_OUT_RUN = 50  # steps held out together: a step's neighbours are near twins of it


def _sibling_busy(logged: list[LoggedStep]) -> list[bool]:
    """Per step: did it start while another engine's step was running (all False without start
    times)? Engines of one host log on one wall clock."""
    if any(step.started_at is None for step in logged):
        return [False] * len(logged)
    runs: dict[int, list[tuple[float, float]]] = {}
    for step in logged:
        runs.setdefault(step.engine, []).append((step.started_at, step.started_at + step.seconds))
    for spans in runs.values():
        spans.sort()
    starts = {e: [a for a, _ in spans] for e, spans in runs.items()}

    def running(engine: int, t: float) -> bool:
        i = bisect.bisect_right(starts[engine], t) - 1
        return i >= 0 and runs[engine][i][1] > t

    return [any(running(e, step.started_at) for e in runs if e != step.engine) for step in logged]


def from_step_logs(paths: list[str], source: str) -> tuple[StepCostModel, list[Sample]]:
    """The step-cost model fitted on logged steps, every fourth run of 50 steps held out, with
    the mean time between two busy steps (the serving loop's, measured) as the time serving adds
    to each step. Replicas that logged side by side also give the factor by which a step is
    longer when another replica is stepping: the form is fitted on the steps that ran alone,
    the factor is the others' measured time over that form's."""
    headers, logged = read_step_logs(paths)
    gaps = [step.gap_s for step in logged if step.gap_s is not None]
    keys = ("model", "dequant_rows", "threads", "block_size", "max_num_batched_tokens")
    if any(k not in h for h in headers for k in (*keys, "dtype", "date")):
        raise ValueError(f"a step log's header lacks the engine's settings ({', '.join(keys)}, "
                         "dtype): not written by --step-log-dir")  # fmt: skip
    kinds = {tuple(h.get(k) for k in keys) for h in headers}
    if len(kinds) != 1:
        settings = "; ".join(str(dict(zip(keys, k, strict=True))) for k in kinds)
        raise ValueError(f"the step logs come from engines of different settings: {settings}")
    busy = _sibling_busy(logged)
    samples = [Sample(step.shape, step.seconds, i // _HELD_OUT_RUN % 4 == 3, busy[i])
               for i, step in enumerate(logged)]  # fmt: skip
    fit = [s for s in samples if not s.held_out]
    test = [s for s in samples if s.held_out]
    if not fit or not test:
        raise ValueError(f"{len(samples)} logged steps are too few to fit and hold out (need > "
                         f"{3 * _HELD_OUT_RUN})")  # fmt: skip
    alone = [s for s in fit if not s.sibling_busy] or fit
    header = headers[0]
    meta = {k: header.get(k) for k in ("model", "dtype", "threads", "block_size",
                                       "max_num_batched_tokens")}  # fmt: skip
    meta |= {"engines": len(headers), "step_logs": [str(p) for p in paths],
             "date": max(h["date"] for h in headers)}  # fmt: skip
    model = StepCostModel.fit([s.shape for s in alone], [s.seconds for s in alone],
                              header.get("dequant_rows"), source=source, meta=meta)  # fmt: skip
    beside = [s for s in fit if s.sibling_busy]
    if beside and alone is not fit:
        predicted = sum(model.step_seconds(s.shape) for s in beside)
        model.sibling_busy_factor = sum(s.seconds for s in beside) / predicted
    model.error = model.held_out_error([s.shape for s in test], [s.seconds for s in test],
                                       [s.sibling_busy for s in test])  # fmt: skip
    model.serving_step_overhead_s = statistics.fmean(gaps) if gaps else 0.0
    model.meta |= {"busy_gaps": len(gaps), "sibling_busy_steps": sum(busy)}
    return model, samples


def plot(model: StepCostModel, samples: list[Sample], path: Path) -> None:
    """Predicted against measured step time on the held-out steps, by kind of step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    kinds = {"decode only": [], "prefill only": [], "mixed": []}
    for s in samples:
        if not s.held_out:
            continue
        decodes = sum(n == 1 for n, _ in s.shape.rows)
        kind = ("decode only" if decodes == len(s.shape.rows) else
                "prefill only" if decodes == 0 else "mixed")  # fmt: skip
        kinds[kind].append((s.seconds * 1000, model.step_seconds(s.shape, s.sibling_busy) * 1000))
    for kind, pts in kinds.items():
        if pts:
            ax.scatter(*zip(*pts, strict=True), s=8, alpha=0.6, label=kind)
    lim = [min(min(p) for pts in kinds.values() for p in pts),
           max(max(p) for pts in kinds.values() for p in pts)]  # fmt: skip
    ax.plot(lim, lim, "k--", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)",
           title=f"held-out steps: mean error {model.error['mean_rel_error']:.0%}")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
