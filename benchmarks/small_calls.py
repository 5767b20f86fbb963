"""Small calls on vLLM: the per-call cost of `capture` over a plain prefill of the same prompts, call by call.

A large call hides a fixed cost per call (round trips to the workers, file handling) and a stall now and then;
a call of one 16-token prompt shows both. On a random ~29M Qwen3-shaped model (8 layers, d_model 512, fp32),
per backend (`vllm`, `vllm-static`) and size (batch x prompt length), this times three paths interleaved round
by round on one engine: plain vLLM prefill (each call salted afresh, so it never reads the prefix cache),
`capture` of one point, and `capture` of resid_post at every layer. It reports each path's p50 and p99 (ms),
the per-call overhead (median of per-round differences against plain), the ratios, and how many calls took
more than twice plain's median (a second, slow mode shows there). Every (run, backend) is its own process.

`--backends ...,vllm-generate` adds the default engine (plain vLLM, default compilation, no taps) as a third
process per run, timing plain prefill only: each `vllm-static` row then also carries `over_default_engine`, its
p50 over the default engine's plain p50 in the same run (two processes: not interleaved, so noisier).

`--out` is written after every process, and each process's part (`OUT.BACKEND.RUN.json`) after every size, so a
benchmark cut short (a timeout) keeps the cells it finished.

    python -m benchmarks.small_calls [--quick] [--runs 2] [--calls 200] [--sizes 1x16,8x16] [--out FILE]
    python -m benchmarks.small_calls --sizes 64x32,64x128 --calls 20 --backends vllm,vllm-static,vllm-generate
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common as B

BACKENDS = ("vllm", "vllm-static")
MODEL = dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=512)
ROOT = Path(__file__).resolve().parents[1]


def model_folder(quick: bool) -> Path:
    import hashlib

    from interp_engine.tiny import build_tiny_model

    config = B.QUICK_MODEL if quick else MODEL
    key = hashlib.sha1(json.dumps(["qwen3", config], sort_keys=True).encode()).hexdigest()[:10]
    folder = B.CACHE / f"qwen3-{key}"
    if not (folder / "interp_engine_tiny.json").exists():
        build_tiny_model("qwen3", folder, overrides=config)
    return folder


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(times: dict[str, list[float]], path: str) -> dict:
    plain, mine = times["plain_prefill"], times[path]
    p50 = statistics.median(plain)
    return {"p50_ms": statistics.median(mine), "p99_ms": percentile(mine, 0.99),
            "plain_p50_ms": p50, "plain_p99_ms": percentile(plain, 0.99),
            "overhead_ms": statistics.median(a - b for a, b in zip(mine, plain)),
            "ratio": statistics.median(mine) / p50, "p99_over_plain_p99": percentile(mine, 0.99) / percentile(plain, 0.99),
            "slow_calls": sum(t > 2 * p50 for t in mine), "plain_slow_calls": sum(t > 2 * p50 for t in plain),
            "calls": len(mine)}


def one_process(backend: str, quick: bool, calls: int, sizes: list[tuple[int, int]], out: str) -> None:
    """Load one engine, time every size's paths interleaved, write the rows as JSON to `out`."""
    import asyncio
    import uuid

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from interp_engine import capture, load_model

    folder = model_folder(quick)
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    every = [f"resid_post.{i}" for i in range(n_layers)]
    one = [f"resid_post.{n_layers // 2}"]
    extra = {"static_points": every} if backend == "vllm-static" else {}
    model = load_model(str(folder), backend=backend, max_model_len=512, **extra)
    asyncio.run(model.warmup())
    llm, rows = model.runtime.llm, []
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True)
    try:
        for batch, seq in sizes:
            ids = B.prompts(model.d_vocab, batch, seq)
            paths = {
                # A fresh salt per call: the baseline never reads the prefix cache, as capture's requests don't.
                "plain_prefill": lambda: llm.generate(
                    [TokensPrompt(prompt_token_ids=p, cache_salt=uuid.uuid4().hex) for p in ids], params,
                    use_tqdm=False),
            }
            if backend != "vllm-generate":  # the default engine: its plain prefill is the baseline itself
                paths["capture_one_point"] = lambda: capture(model, ids, one, progress=False)
                paths["capture_resid_post_all"] = lambda: capture(model, ids, every, progress=False)
            names = list(paths)
            for _ in range(3):
                for call in paths.values():
                    call()
            times: dict[str, list[float]] = {n: [] for n in names}
            for rep in range(calls):
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    start = time.perf_counter()
                    paths[name]()
                    times[name].append((time.perf_counter() - start) * 1e3)
            for path in names[1:] or names:
                rows.append({"backend": backend, "batch": batch, "seq": seq, "path": path, **summary(times, path)})
            Path(out).write_text(json.dumps(rows))  # after every size: a run cut short keeps its finished cells
            print(f"{backend} {batch}x{seq}: " + ", ".join(
                f"{n} p50 {statistics.median(t):.1f} p99 {percentile(t, 0.99):.1f} ms" for n, t in times.items()),
                flush=True)
    finally:
        asyncio.run(model.shutdown())


def against_default_engine(rows: list[dict]) -> None:
    """Each vllm-static row's p50 over the default engine's plain p50 at its size and run, where one was timed."""
    default = {(r["run"], r["batch"], r["seq"]): r["plain_p50_ms"] for r in rows if r["backend"] == "vllm-generate"}
    for row in rows:
        if row["backend"] == "vllm-static" and (key := (row["run"], row["batch"], row["seq"])) in default:
            row["over_default_engine"] = row["p50_ms"] / default[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small benchmark model, 10 calls, 1 run, 1x16")
    parser.add_argument("--runs", type=int, default=2, help="separate processes per backend")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", default="1x16,8x16", help="batch x prompt length, comma-separated")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--out", default="out/bench/small_calls.json")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in ("1x16" if args.quick else args.sizes).split(",")]
    calls, runs = (10, 1) if args.quick else (args.calls, args.runs)
    if args.child:
        one_process(args.child[0], args.quick, calls, sizes, args.child[1])
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_folder(args.quick)  # built once, before the runs
    results, failed = [], []

    def save() -> None:  # after every process: a benchmark stopped (a timeout) keeps every cell it finished
        against_default_engine(results)
        out.write_text(json.dumps({"model": str(model_folder(args.quick)), "calls": calls, "runs": runs,
                                   "busy_at_end": B.busy_fraction(), "env": B.env_info(), "rows": results,
                                   **({"failed": failed} if failed else {})}, indent=1))

    for run in range(runs):
        for backend in args.backends.split(","):
            part = out.with_suffix(f".{backend}.{run}.json")
            part.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "benchmarks.small_calls", "--calls", str(calls), "--sizes",
                   ",".join(f"{b}x{s}" for b, s in sizes), *(["--quick"] if args.quick else []),
                   "--child", backend, str(part)]
            code = subprocess.run(cmd, cwd=ROOT).returncode
            if code:
                failed.append(f"run {run} {backend}: exit {code}")
            if part.exists():  # a failed process's finished sizes count too
                results += [{**row, "run": run} for row in json.loads(part.read_text())]
                part.unlink()
            save()
    for row in results:
        print(f"run {row['run']} {row['backend']:12} {row['batch']}x{row['seq']:<4} {row['path']:24} "
              f"p50 {row['p50_ms']:6.1f} (plain {row['plain_p50_ms']:6.1f})  p99 {row['p99_ms']:6.1f} "
              f"(plain {row['plain_p99_ms']:6.1f})  overhead {row['overhead_ms']:+6.1f} ms  ratio {row['ratio']:.2f}  "
              f"slow {row['slow_calls']}/{row['calls']} (plain {row['plain_slow_calls']})"
              + (f"  over default engine {row['over_default_engine']:.3f}" if "over_default_engine" in row else ""))
    if failed:
        sys.exit(f"incomplete: {'; '.join(failed)} (the finished cells are in {out})")


if __name__ == "__main__":
    main()
