"""SAEs: what reading and steering through a 16x-wide SAE costs over the same call without it.

On the benchmark model (benchmarks/common.py: the ~104M Llama, or the quick one), one random SAE of resid_post at
the middle layer, 16 x d_model features (relu), per backend (`eager`, `vllm`, `vllm-static`) and size:
- feature capture: `capture(model, x, [sae.features])` and the sparse `[sae.top_features(32)]` against
  `capture(model, x, [sae.reads])` (the raw point), timed interleaved in the same rounds;
- steered decode: `generate` with one feature clamped (`S.Clamp(sae, [f], to=...)`, at every step) against
  plain `generate`, T new tokens, EOS ignored; target ratio <= 1.10. On vllm-static the SAE is declared at load
  (`static_writes=[sae]`), so the clamp runs in the compiled graph, and plain decode runs on the same engine.
Every (run, backend) is its own process; the report gives each ratio's median over runs with its spread (the
smallest and largest run's ratio), and every run's rows.

    python -m benchmarks.sae [--quick] [--runs 2] [--reps 7] [--backends eager,vllm,vllm-static]
                             [--sizes 1x16,2x32,4x64] [--out benchmarks/results/sae.json]
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import common as B

BACKENDS = ("eager", "vllm", "vllm-static")
WIDTH, TOP_K, FEATURE, CLAMP_TO = 16, 32, 7, 20.0
FEATURES = "feature capture (16x SAE, one layer)"
DECODE = "steered decode (one feature clamp)"
TARGET = 1.10  # steered decode over plain decode
ROOT = Path(__file__).resolve().parents[1]


def random_sae(d: int, point: str):
    import torch

    from interp_engine import SAE

    g, wide = torch.Generator().manual_seed(0), WIDTH * d
    return SAE(torch.randn(d, wide, generator=g) / d ** 0.5, 0.1 * torch.randn(wide, generator=g),
               torch.randn(wide, d, generator=g) / d ** 0.5, 0.1 * torch.randn(d, generator=g), point)


def one_process(backend: str, quick: bool, reps: int, max_wait_s: float, sizes: list[tuple[int, int]],
                out: str) -> None:
    """Load one handle, time every size's paths interleaved, write the rows as JSON to `out`."""
    import asyncio

    import torch

    from interp_engine import capture, generate, load_model
    from interp_engine import spec as S
    from interp_engine.loading import read_config

    torch.set_num_threads(B.threads())
    folder = B.bench_model(quick)
    config = read_config(str(folder))[1]
    point = f"resid_post.{config.num_hidden_layers // 2}"
    sae = random_sae(config.hidden_size, point)
    top = sae.top_features(TOP_K)
    new = B.QUICK_NEW_TOKENS if quick else B.FULL_NEW_TOKENS
    kwargs = {"eager": dict(device="cpu"), "vllm": dict(max_model_len=512),
              "vllm-static": dict(max_model_len=512, static_points=[point], static_writes=[sae])}[backend]
    model = load_model(str(folder), backend=backend, **kwargs)
    if backend != "eager":
        asyncio.run(model.warmup())
    clamp = S.Clamp(sae, [FEATURE], to=CLAMP_TO)
    rows, wait = [], B.IdleWaiter(max_wait_s)
    try:
        for batch, seq in sizes:
            ids = B.prompts(model.d_vocab, batch, seq)
            paths = {"capture_point": lambda: capture(model, ids, [point], progress=False),
                     "capture_features": lambda: capture(model, ids, [sae.features], progress=False),
                     "capture_top_features": lambda: capture(model, ids, [top], progress=False),
                     "plain_decode": lambda: generate(model, ids, max_new_tokens=new, stop_at_eos=False,
                                                      progress=False),
                     "clamped_decode": lambda: generate(model, ids, clamp, max_new_tokens=new, stop_at_eos=False,
                                                        progress=False)}
            with torch.inference_mode():
                timed = B.time_paths(paths, reps, 1, wait)
            rows += [B.row(backend, FEATURES, batch, seq, "capture_features", "capture_point", timed),
                     B.row(backend, FEATURES, batch, seq, "capture_top_features", "capture_point", timed,
                           note=f"top {TOP_K} per position"),
                     B.row(backend, DECODE, batch, seq, "clamped_decode", "plain_decode", timed, tokens=batch * new)]
            print(f"{backend} {batch}x{seq}: " + ", ".join(f"{k} {v:.0f} ms" for k, v in timed["median_ms"].items()),
                  flush=True)
    finally:
        if backend != "eager":
            asyncio.run(model.shutdown())
    Path(out).write_text(json.dumps({"rows": rows, "d_sae": sae.d_sae, "point": point, "new_tokens": new,
                                     "threads": torch.get_num_threads()}))


def summarise(rows: list[dict]) -> list[dict]:
    """Per (backend, scenario, size, path): the median of the runs' ratios and their spread."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if "ratio" in r:
            groups.setdefault((r["suite"], r["scenario"], r["batch"], r["seq"], r["path"]), []).append(r)
    out = []
    for (backend, scenario, batch, seq, path), runs in groups.items():
        ratios = [r["ratio"] for r in runs]
        out.append({"backend": backend, "scenario": scenario, "batch": batch, "seq": seq, "path": path,
                    "baseline": runs[0]["baseline"], "ratio": statistics.median(ratios), "ratio_low": min(ratios),
                    "ratio_high": max(ratios), "path_ms": statistics.median(r["path_ms"] for r in runs),
                    "baseline_ms": statistics.median(r["baseline_ms"] for r in runs), "runs": len(runs),
                    "noisy_rounds": sum(r["noisy_rounds"] for r in runs),
                    **({"target": TARGET, "meets_target": statistics.median(ratios) <= TARGET}
                       if scenario == DECODE else {})})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small benchmark model, one size, 3 reps")
    parser.add_argument("--runs", type=int, default=2, help="separate processes per backend (at least 2)")
    parser.add_argument("--reps", type=int, default=7, help="interleaved rounds per size")
    parser.add_argument("--max-wait-s", type=float, default=600.0, help="total wait for an idle machine per run")
    parser.add_argument("--sizes", default=",".join(f"{b}x{s}" for b, s in B.FULL_SIZES))
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sae.json"))
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.reps, args.max_wait_s = list(B.QUICK_SIZES), min(args.reps, 3), 0.0
    if args.child:
        one_process(args.child[0], args.quick, args.reps, args.max_wait_s, sizes, args.child[1])
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    B.bench_model(args.quick)  # built once, before the runs
    rows, info = [], {}
    for run in range(args.runs):
        for backend in args.backends.split(","):
            part = out.with_suffix(f".{backend}.{run}.json")
            cmd = [sys.executable, "-m", "benchmarks.sae", "--reps", str(args.reps), "--max-wait-s",
                   str(args.max_wait_s), "--sizes", ",".join(f"{b}x{s}" for b, s in sizes),
                   *(["--quick"] if args.quick else []), "--child", backend, str(part)]
            subprocess.run(cmd, cwd=ROOT, check=True)
            child = json.loads(part.read_text())
            part.unlink()
            rows += [{**r, "run": run} for r in child.pop("rows")]
            info = child
    summary = summarise(rows)
    out.write_text(json.dumps({"model": str(B.bench_model(args.quick)), "runs": args.runs, "reps": args.reps,
                               **info, "busy_at_end": B.busy_fraction(), "env": B.env_info(), "summary": summary,
                               "rows": rows}, indent=1))
    for s in summary:
        target = f"  (target <= {TARGET}: {'met' if s['meets_target'] else 'NOT met'})" if "target" in s else ""
        print(f"{s['backend']:12} {s['batch']}x{s['seq']:<4} {s['path']:22} / {s['baseline']:14} "
              f"{s['ratio']:.2f} [{s['ratio_low']:.2f}, {s['ratio_high']:.2f}] over {s['runs']} runs  "
              f"({s['path_ms']:.0f} vs {s['baseline_ms']:.0f} ms){target}")


if __name__ == "__main__":
    main()
