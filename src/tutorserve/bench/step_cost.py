"""How long one engine step takes, as a function of what it computes: a small linear model fitted
on measured steps (`bench calibrate`), or derived from a device's datasheet numbers.

Form (seconds): t = c0 + c1·T + c2·R + c3·D + c4·P + c5·A + c6·L + c7·Q, where T is the tokens
the step computes, R its rows (requests), D the KV tokens its decode rows read, P the attention
pairs of its prefill rows (Σ n·(c + n/2) for n new tokens after c cached ones), A the distinct
LoRA adapters, L the tokens that run one, and Q is 1 when T exceeds the rows that quantized
weights multiply on their blocks (`quant/layers.py`), else 0. c0 is reading the weights and the
step's fixed overhead, c1 the matmuls per token, c3 decode attention's KV reads, c4 prefill
attention, c7 dequantizing the weights for a GEMM: a chunk just past the rows pays it as a
1,000-token one does, which no line in T can say (fitted without it, when the rows were 64,
chunks of 65-110 tokens after a cached course prompt ran 20-25 % over their prediction in the
server: docs/benchmarks/planner.md). Coefficients are
fitted non-negative (a negative cost has no meaning and extrapolates badly), which also keeps
the model monotone in every feature, as the simulator's planner search needs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from tutorserve.engine.scheduler import StepShape

# New features go last: a model saved before one existed predicts without it (`load`).
FEATURES = ("const", "tokens", "rows", "decode_kv", "prefill_pairs", "adapters", "lora_tokens",
            "dequant_steps")  # fmt: skip


def features(shape: StepShape, dequant_rows: int | None = None) -> list[float]:
    tokens = sum(n for n, _ in shape.rows)
    decode_kv = sum(c + 1 for n, c in shape.rows if n == 1)
    pairs = sum(n * (c + n / 2) for n, c in shape.rows if n > 1)
    dequant = float(dequant_rows is not None and tokens > dequant_rows)
    return [1.0, tokens, len(shape.rows), decode_kv, pairs, shape.num_adapters, shape.lora_tokens,
            dequant]  # fmt: skip


def _nonnegative_lstsq(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with coefficients ≥ 0: refit without the most negative one until
    none is."""
    active = list(range(x.shape[1]))
    while True:
        coef, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if coef.min() >= 0 or len(active) == 1:
            out = np.zeros(x.shape[1])
            out[active] = np.maximum(coef, 0)
            return out
        del active[int(coef.argmin())]


def fit_nonnegative(x: np.ndarray, y: np.ndarray, huber: float = 0.2) -> np.ndarray:
    """Coefficients ≥ 0 minimising relative error (rows weighted by 1/y, so the short decode
    steps, which are most steps, count as much as long prefills), robustly: a step more than
    `huber` off the fit (another process took the core for a while) is down-weighted, Huber
    style, over a few reweighted refits."""
    base = 1.0 / np.maximum(y, 1e-6)
    w = base
    for _ in range(8):
        coef = _nonnegative_lstsq(x, y, w)
        rel = np.abs(x @ coef - y) * base
        w = base * np.minimum(1.0, huber / np.maximum(rel, 1e-12))
    return coef


@dataclass(slots=True)
class StepCostModel:
    coef: list[float]
    measured: bool  # fitted on this host's steps, or derived from datasheet numbers
    source: str  # the host (CPU, ISA, threads) or the hardware description
    # Model and engine settings the steps were measured under (checked by the simulator).
    meta: dict[str, Any] = field(default_factory=dict)
    # Held-out error: median, mean and p90 of |pred − measured| / measured per step, and the
    # error of the summed time of all held-out steps.
    error: dict[str, float] = field(default_factory=dict)
    # Copying one KV block from the host-RAM tier into the pool (inside the admitting step).
    restore_s_per_block: float | None = None
    # What serving adds to the engine alone (`sim fit-serving`, from measured serving runs): the
    # time from a client's send to the engine's queue (HTTP, chat template, tokenizer, a Ray
    # Serve hop), and a fixed time per step (streaming each step's tokens out through the
    # server, whose threads share the cores): added, not scaled, since it does not grow with
    # what the step computes.
    request_overhead_s: float = 0.0
    serving_step_overhead_s: float = 0.0
    # Tokens per step above which the weights are dequantized (`quant.layers.dequantizing_rows`
    # of the calibrated model); None: not quantized, no step pays it.
    dequant_rows: int | None = None
    # Replicas sharing one host (fitted on their step logs): a step that starts while another
    # replica is stepping takes this many times as long (cores, memory bandwidth, the serving
    # processes of both); 1 for one engine, or a host of its own.
    sibling_busy_factor: float = 1.0

    def step_seconds(self, shape: StepShape, sibling_busy: bool = False) -> float:
        cost = float(np.dot(self.coef, features(shape, self.dequant_rows)))
        if sibling_busy:
            cost *= self.sibling_busy_factor
        return cost + self.serving_step_overhead_s

    @classmethod
    def fit(
        cls, shapes: list[StepShape], seconds: list[float], dequant_rows: int | None, **kw: Any
    ) -> StepCostModel:
        x = np.array([features(s, dequant_rows) for s in shapes])
        coef = fit_nonnegative(x, np.array(seconds))
        return cls(coef.tolist(), True, dequant_rows=dequant_rows, **kw)

    def held_out_error(
        self, shapes: list[StepShape], seconds: list[float], sibling_busy: list[bool] | None = None
    ) -> dict[str, float]:
        busy = sibling_busy or [False] * len(shapes)
        pred = np.array([self.step_seconds(s, b) for s, b in zip(shapes, busy, strict=True)])
        y = np.array(seconds)
        rel = np.abs(pred - y) / y
        return {
            "steps": len(y),
            "median_rel_error": float(np.median(rel)),
            "mean_rel_error": float(rel.mean()),
            "p90_rel_error": float(np.percentile(rel, 90)),
            "total_time_error": float(abs(pred.sum() - y.sum()) / y.sum()),
        }

    @classmethod
    def from_hardware(
        cls, hw: Hardware, model: ModelCosts, overhead_s: float, block_size: int = 16
    ) -> StepCostModel:
        """A roofline estimate, not a measurement: weights read once per step at memory
        bandwidth, 2 FLOPs per parameter per token at the device's rate (whichever bounds the
        step: approximated by summing, which is exact at both ends), KV reads at bandwidth;
        restores from the RAM tier over the host link."""
        bw, flops = hw.mem_bandwidth_gbs * 1e9 * hw.efficiency, hw.tflops * 1e12 * hw.efficiency
        coef = [
            overhead_s + model.weight_bytes / bw,
            2 * model.params / flops,
            0.0,
            model.kv_bytes_per_token / bw,
            4 * model.attn_dim * model.layers / flops,
            0.0,
            0.0,
            0.0,
        ]
        block = model.kv_bytes_per_token * block_size
        return cls(
            coef,
            False,
            f"{hw.name} (datasheet numbers × {hw.efficiency:g}; not measured)",
            restore_s_per_block=block / (hw.host_link_gbs * 1e9 * hw.efficiency),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"features": FEATURES, **asdict(self)}, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        data = json.loads(Path(path).read_text())
        unknown = set(data) - {"features", *(f.name for f in fields(cls))}
        saved = tuple(data.pop("features", ()))
        coef = data.get("coef", [])
        outdated = ValueError(f"{path}: not a step-cost model of this version (rerun calibrate)")
        if not saved or FEATURES[: len(saved)] != saved or len(coef) != len(saved) or unknown:
            raise outdated
        # Fitted before the later features existed: it predicts as it did when it was saved.
        data["coef"] = coef + [0.0] * (len(FEATURES) - len(saved))
        try:
            return cls(**data)
        except TypeError as e:  # a field it needs is missing
            raise outdated from e


@dataclass(frozen=True, slots=True)
class Hardware:
    """A device described by its datasheet, for planning on hardware we cannot measure."""

    name: str
    mem_gib: float
    mem_bandwidth_gbs: float
    tflops: float  # dense bf16
    host_link_gbs: float  # host RAM to device (PCIe), for KV restored from the RAM tier
    # Share of peak a serving engine reaches (vLLM-class engines reach roughly half to 70 % of
    # bandwidth in decode); an assumption, stated wherever the model is used.
    efficiency: float = 0.6


HARDWARE = {
    h.name: h
    for h in (
        Hardware("a10g-24g", 24, 600, 125, 32),
        Hardware("l4-24g", 24, 300, 121, 32),
        Hardware("a100-80g", 80, 2039, 312, 32),
        Hardware("h100-80g", 80, 3350, 989, 64),
        Hardware("h200-141g", 141, 4800, 989, 64),
    )
}


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """What a model costs per step, from its config (`models.config.ModelConfig`)."""

    params: float
    weight_bytes: float
    kv_bytes_per_token: float  # K and V, every layer
    attn_dim: int  # query heads × head dim
    layers: int

    @classmethod
    def of(cls, cfg: Any, weight_dtype_bytes: int = 2, kv_dtype_bytes: int = 2) -> ModelCosts:
        h, layers, inter = cfg.hidden_size, cfg.num_layers, cfg.intermediate_size
        kv = cfg.num_kv_heads * cfg.head_dim
        attn = cfg.num_heads * cfg.head_dim
        per_layer = h * attn * 2 + h * kv * 2 + 3 * h * inter
        params = layers * per_layer + cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
        return cls(
            float(params),
            float(params * weight_dtype_bytes),
            float(cfg.kv_bytes_per_token(kv_dtype_bytes)),
            attn,
            layers,
        )
