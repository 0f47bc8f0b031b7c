"""`tutorserve bench ...` subcommands."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

from tutorserve.models.registry import DEFAULT_MODEL

log = logging.getLogger(__name__)
ALL_SYSTEMS = (
    "tutorserve",
    "tutorserve-warm",
    "tutorserve-nocache",
    "transformers",
    "vllm",
    "vllm-allcores",
)
WARM = "tutorserve (prefix cache, courses warm)"


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="education-shaped offline workload vs peers")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--systems",
        default=",".join(ALL_SYSTEMS),
        help=f"comma-separated subset of {','.join(ALL_SYSTEMS)}",
    )
    p.add_argument("--courses", type=int, default=8)
    p.add_argument("--students", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--kv-cache-gb", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--scheduling", default="cache-aware", choices=["cache-aware", "fcfs"])
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG results")
    p.set_defaults(func=cmd_offline)

    p = bench.add_parser("profile-decode", help="torch.profiler table of decode steps")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    p.set_defaults(func=cmd_profile_decode)


def cmd_offline(a: argparse.Namespace) -> int:
    from tutorserve.bench import offline, report
    from tutorserve.bench.workloads import edu_shared_prefix
    from tutorserve.models.loader import load_tokenizer
    from tutorserve.models.registry import resolve

    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown system(s): {', '.join(sorted(unknown))}")
    if a.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    tok = load_tokenizer(a.model)
    shape = dict(
        courses=a.courses,
        students=a.students,
        prefix_tokens=a.prefix_tokens,
        question_tokens=a.question_tokens,
        output_tokens=a.output_tokens,
    )
    warm = edu_shared_prefix(tok, seed=0, **shape)
    runs = [edu_shared_prefix(tok, seed=k + 1, **shape) for k in range(a.repeats)]
    engine_opts = dict(
        dtype=a.dtype,
        kv_cache_bytes=int(a.kv_cache_gb * 2**30),
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        scheduling=a.scheduling,
    )
    results: dict[str, list[offline.SystemResult]] = {}
    peers = {"transformers", "vllm", "vllm-allcores"} & set(systems)
    hf_dir = _hf_dir(a.model, resolve(a.model)) if peers else ""
    for system in systems:
        log.info("benchmarking %s", system)
        if system == "tutorserve":
            results["tutorserve (prefix cache)"] = offline.run_tutorserve(
                system, a.model, runs, warm, **engine_opts
            )
        elif system == "tutorserve-warm":
            primes = [
                edu_shared_prefix(
                    tok, seed=k + 1, question_seed=10_000 + k, **shape | {"students": 1}
                )
                for k in range(a.repeats)
            ]
            results[WARM] = offline.run_tutorserve(
                system, a.model, runs, warm, primes=primes, **engine_opts
            )
        elif system == "tutorserve-nocache":
            results["tutorserve (no prefix cache)"] = offline.run_tutorserve(
                system, a.model, runs, warm, enable_prefix_caching=False, **engine_opts
            )
        elif system == "transformers":
            res = offline.run_transformers(hf_dir, runs, warm, a.hf_batch_size, a.dtype)
            results[res[0].system] = res
        else:
            all_cores = system == "vllm-allcores"
            vres = [offline.run_vllm(hf_dir, t, a.max_num_seqs, all_cores) for t in runs]
            if all(vres):
                results[vres[0].system] = vres
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": " ".join(["tutorserve", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "workload": shape
        | {
            "requests": len(runs[0]),
            "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in runs[0]) / len(runs[0]),
        },
    }
    (out / "offline.json").write_text(
        json.dumps(
            {"meta": meta, "results": {k: [asdict(r) for r in v] for k, v in results.items()}},
            indent=1,
        )
    )
    report.plot(
        results,
        out / "offline.png",
        f"offline edu-shared-prefix, {a.model}, {a.dtype}, {len(runs[0])} requests",
    )
    print(report.markdown_table(results))
    print()
    print(goals(results))
    print(f"\nresults: {out / 'offline.json'}, plot: {out / 'offline.png'}")
    return 0


def cmd_profile_decode(a: argparse.Namespace) -> int:
    from tutorserve.bench.profile import profile_decode

    print(profile_decode(a.model, a.dtype, a.steps, a.rows))
    return 0


def goals(results: dict) -> str:
    from tutorserve.bench.report import mean_extra, median_run, ratio

    lines = []
    ours = results.get("tutorserve (prefix cache)")
    nocache = results.get("tutorserve (no prefix cache)")
    if ours:
        m = median_run(ours)
        for name, runs in results.items():
            if not name.startswith("tutorserve"):
                lines.append(
                    f"- throughput vs {name}: {ratio(m.output_tps, median_run(runs).output_tps)}"
                )
        if nocache:
            a, b = m.summary()["ttft_mean_s"], median_run(nocache).summary()["ttft_mean_s"]
            lines.append(
                f"- prefix caching cuts mean TTFT by {100 * (1 - a / b):.0f}% "
                f"({b:.2f} s → {a:.2f} s)"
            )
        e = m.extra
        contiguous = e["num_kv_blocks"] * e["block_size"] // e["max_model_len"]
        lines.append(
            f"- KV budget {e['num_kv_blocks']} blocks × {e['block_size']} tokens: peak "
            f"{e['peak_running']} concurrent sequences (peak {e['peak_used_blocks']} blocks used) "
            f"vs {contiguous} with contiguous allocation at max context {e['max_model_len']}"
        )
        share = mean_extra(ours, "decode_overhead_share_b32")
        if share is not None:
            lines.append(
                f"- engine overhead in decode steps at batch ≥ 32: {100 * share:.1f}% "
                f"of step time outside the model forward"
            )
    return "\n".join(lines)


def _hf_dir(model: str, path: Path) -> str:
    if path.is_dir():
        return str(path)
    from tutorserve.bench.hf_export import export_gguf_to_hf
    from tutorserve.bench.offline import cache_dir

    return export_gguf_to_hf(str(path), str(cache_dir() / "hf" / model.replace("/", "_")))
