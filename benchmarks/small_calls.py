"""Small calls on vLLM: the per-call cost of `capture` over a plain prefill of the same prompts, call by call.

A large call hides a fixed cost per call (round trips to the workers, file handling) and a stall now and then;
a call of one 16-token prompt shows both. On a random ~29M Qwen3-shaped model (8 layers, d_model 512, fp32),
per backend (`vllm`, `vllm-static`) and size (batch x prompt length), this times three paths interleaved round
by round on one engine: plain vLLM prefill (each call salted afresh, so it never reads the prefix cache),
`capture` of one point, and `capture` of resid_post at every layer. It reports each path's p50 and p99 (ms),
the per-call overhead (median of per-round differences against plain), the ratios, how many calls took
more than twice plain's median (a second, slow mode shows there), and how many engine steps a call took: plain
vLLM's requests start a step as the first arrives, a capture's run together (`gather.py`). Every (run, backend)
is its own process.

With `--default-engine`, on `vllm-static` a fourth path is vLLM's default engine (`LLM(model)`: default
compilation, no taps, the same dtype and lengths) alive in the same process, its plain prefill interleaved with the
others round by round (two processes were noisier by several percent than the target's 3%): each row's
`over_default_engine` is its p50 over the default engine's, `over_default_paired` the median of the per-round
ratios. Before a call on the other engine the benchmark waits IDLE_S: a vLLM worker spins on its input queue
(`sched_yield`) for 1 s after each step, on the core the other engine's worker computes on. Our CPU engine starts
with allocator settings of its own (`allocator.py`), which speed plain vLLM's prefill too; `--same-allocator`
starts the default engine with them as well, so that the ratio is of our instrumentation alone.

`--out` is written after every process, and each process's part (`OUT.BACKEND.RUN.json`) after every size, so a
benchmark cut short (a timeout) keeps the cells it finished.

    python -m benchmarks.small_calls [--quick] [--runs 2] [--calls 200] [--sizes 1x16,8x16] [--out FILE]
    python -m benchmarks.small_calls --sizes 64x32,64x128 --calls 7 --runs 2 --default-engine [--same-allocator]
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
# vLLM 0.32's worker busy-waits 1 s after its last read before it sleeps (shm_broadcast's SpinCondition)
IDLE_S = 1.2


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
    default = times.get("default_engine_prefill")
    against = {"default_p50_ms": statistics.median(default),
               "over_default_engine": statistics.median(mine) / statistics.median(default),
               "over_default_paired": statistics.median(a / b for a, b in zip(mine, default))} if default else {}
    return {**against, "p50_ms": statistics.median(mine), "p99_ms": percentile(mine, 0.99),
            "plain_p50_ms": p50, "plain_p99_ms": percentile(plain, 0.99),
            "overhead_ms": statistics.median(a - b for a, b in zip(mine, plain)),
            "ratio": statistics.median(mine) / p50, "p99_over_plain_p99": percentile(mine, 0.99) / percentile(plain, 0.99),
            "slow_calls": sum(t > 2 * p50 for t in mine), "plain_slow_calls": sum(t > 2 * p50 for t in plain),
            "calls": len(mine)}


def one_process(backend: str, quick: bool, calls: int, sizes: list[tuple[int, int]], out: str,
                with_default: bool, same_allocator: bool = False) -> None:
    """Load one engine, time every size's paths interleaved, write the rows as JSON to `out`."""
    import asyncio
    import uuid

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from interp_engine import capture, load_model
    from interp_engine.backends.vllm import compat

    folder = model_folder(quick)
    n_layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    every = [f"resid_post.{i}" for i in range(n_layers)]
    one = [f"resid_post.{n_layers // 2}"]
    extra = {"static_points": every} if backend == "vllm-static" else {}
    model = load_model(str(folder), backend=backend, max_model_len=512, **extra)
    asyncio.run(model.warmup())
    llm, rows = model.runtime.llm, []
    default = default_engine(folder, same_allocator) if with_default and backend == "vllm-static" else None
    steps = [count_steps(engine) for engine in (llm, default) if engine is not None]
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
            paths["capture_one_point"] = lambda: capture(model, ids, one, progress=False)
            paths["capture_resid_post_all"] = lambda: capture(model, ids, every, progress=False)
            if default is not None:
                paths["default_engine_prefill"] = lambda: default.generate(
                    [TokensPrompt(prompt_token_ids=p, cache_salt=uuid.uuid4().hex) for p in ids], params,
                    use_tqdm=False)
            names = list(paths)
            for _ in range(3):
                for call in paths.values():
                    call()
            times: dict[str, list[float]] = {n: [] for n in names}
            stepped: dict[str, int] = dict.fromkeys(names, 0)
            engine = None
            for rep in range(calls):
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    if engine is not None and engine != (name == "default_engine_prefill"):
                        time.sleep(IDLE_S)  # the other engine's worker stops spinning first
                    engine = name == "default_engine_prefill"
                    before = sum(s[0] for s in steps)
                    start = time.perf_counter()
                    paths[name]()
                    times[name].append((time.perf_counter() - start) * 1e3)
                    stepped[name] += sum(s[0] for s in steps) - before
            per_call = {n: stepped[n] / calls for n in names}
            for path in names[1:]:
                rows.append({"backend": backend, "batch": batch, "seq": seq, "path": path, **summary(times, path),
                             "steps_per_call": per_call[path], "plain_steps_per_call": per_call["plain_prefill"],
                             **({"default_steps_per_call": per_call["default_engine_prefill"]} if default else {})})
            Path(out).write_text(json.dumps(rows))  # after every size: a run cut short keeps its finished cells
            print(f"{backend} {batch}x{seq}: " + ", ".join(
                f"{n} p50 {statistics.median(t):.1f} p99 {percentile(t, 0.99):.1f} ms" for n, t in times.items()),
                flush=True)
    finally:
        if default is not None:
            compat.shutdown(default)
        asyncio.run(model.shutdown())


def count_steps(llm) -> list[int]:
    """A counter of the engine's steps as its driver takes them (each one engine core step's outputs): a call whose
    requests the core splits over two steps pays a step's fixed cost twice (`gather.py`)."""
    counted, step = [0], llm.llm_engine.step

    def counting():
        counted[0] += 1
        return step()

    llm.llm_engine.step = counting
    return counted


def default_engine(folder: Path, same_allocator: bool = False):
    """vLLM's default engine for the model: plain `LLM`, the benchmark's dtype and lengths, nothing of ours; with
    `same_allocator`, its processes started with the allocator settings ours start with (`allocator.py`), so the
    comparison is of our instrumentation alone."""
    from vllm import LLM

    from interp_engine import allocator
    from interp_engine.backends.vllm.procs import environ

    with environ(allocator.environ() if same_allocator else {}):
        return LLM(model=str(folder), dtype="float32", max_model_len=512, skip_tokenizer_init=True, seed=0,
                   kv_cache_memory_bytes=1 << 30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small benchmark model, 10 calls, 1 run, 1x16")
    parser.add_argument("--runs", type=int, default=2, help="separate processes per backend")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--sizes", default="1x16,8x16", help="batch x prompt length, comma-separated")
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--default-engine", action="store_true",
                        help="on vllm-static, also time vLLM's default engine in the same process")
    parser.add_argument("--same-allocator", action="store_true",
                        help="start the default engine with our engine's allocator settings (allocator.py)")
    parser.add_argument("--out", default="out/bench/small_calls.json")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [tuple(map(int, s.split("x"))) for s in ("1x16" if args.quick else args.sizes).split(",")]
    calls, runs = (10, 1) if args.quick else (args.calls, args.runs)
    if unknown := set(args.backends.split(",")) - set(BACKENDS):
        parser.error(f"--backends {','.join(sorted(unknown))}: choose from {', '.join(BACKENDS)} (vLLM's default "
                     "engine is --default-engine)")
    if args.child:
        one_process(args.child[0], args.quick, calls, sizes, args.child[1], args.default_engine, args.same_allocator)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_folder(args.quick)  # built once, before the runs
    results, failed = [], []

    def save() -> None:  # after every process: a benchmark stopped (a timeout) keeps every cell it finished
        out.write_text(json.dumps({"model": str(model_folder(args.quick)), "calls": calls, "runs": runs,
                                   "busy_at_end": B.busy_fraction(), "env": B.env_info(), "rows": results,
                                   **({"failed": failed} if failed else {})}, indent=1))

    for run in range(runs):
        for backend in args.backends.split(","):
            part = out.with_suffix(f".{backend}.{run}.json")
            part.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "benchmarks.small_calls", "--calls", str(calls), "--sizes",
                   ",".join(f"{b}x{s}" for b, s in sizes), *(["--quick"] if args.quick else []),
                   *(["--default-engine"] if args.default_engine else []),
                   *(["--same-allocator"] if args.same_allocator else []), "--child", backend, str(part)]
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
              f"slow {row['slow_calls']}/{row['calls']} (plain {row['plain_slow_calls']})  "
              f"steps/call {row['steps_per_call']:.2f} (plain {row['plain_steps_per_call']:.2f})"
              + (f"  over default engine {row['over_default_engine']:.3f} (paired {row['over_default_paired']:.3f})"
                 if "over_default_engine" in row else ""))
    if failed:
        sys.exit(f"incomplete: {'; '.join(failed)} (the finished cells are in {out})")


if __name__ == "__main__":
    main()
