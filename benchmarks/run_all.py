"""The benchmark driver: every scenario against its baseline, on every backend, in one run.

Each suite runs in its own subprocess (one vLLM engine per process): eager vs HF (suite_eager), the peers vs HF
(suite_peers, in the peers' Python), and each vLLM backend vs plain vLLM on its own engine (suite_vllm). A full
run repeats the whole set in separate processes (--runs, 2 by default): one process's ratio can be off by several
percent on a small machine, and only separate runs show how far. The results merge into results.json,
results.md (ratios) and results.png; --update-readme rewrites the README's performance section from them.

    benchmarks/run_all.sh [--quick] [--runs N] [--num-gpus N] [--model FAMILY|FOLDER|REPO] [--sizes 64x32,...]
                          [--update-readme]
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common as B
from benchmarks import report

ROOT = Path(__file__).resolve().parents[1]
SUITES = ("eager", "peers", "vllm", "vllm-static", "vllm-generate")
SUITE_TIMEOUT_S = 1800
PEERS_PYTHON = os.environ.get("PEERS_PYTHON", "/work/peers-venv/bin/python")


def default_num_gpus() -> int:
    """NUM_GPUS if set; else every visible CUDA card; else 1 (a CPU benchmark split over one-core ranks would
    measure the split, not the library)."""
    if os.environ.get("NUM_GPUS"):
        return int(os.environ["NUM_GPUS"])
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def resolve_model(name: str | None, quick: bool) -> Path | str:
    if name is None:
        return B.bench_model(quick)
    from interp_engine.tiny import FAMILIES

    if name in FAMILIES:
        return B.bench_model(quick, name)
    return name  # a folder, or a repo id in the local HF cache (load_model says so if it is not)


def run_suite(suite: str, settings: B.Settings, out: Path, run: int = 0) -> dict:
    target = out / f"suite.{suite}.{run}.json"
    target.unlink(missing_ok=True)
    python, module, extra = sys.executable, "benchmarks.suite_vllm", [suite]
    if suite == "eager":
        module, extra = "benchmarks.suite_eager", []
    elif suite == "peers":
        module, extra = "benchmarks.suite_peers", []
        if not Path(PEERS_PYTHON).exists():
            return {"suite": suite, "rows": [B.refused(suite, "capture resid_post (all layers)", "peers",
                                                       f"no peers' Python at {PEERS_PYTHON} (set PEERS_PYTHON)")]}
        python = PEERS_PYTHON
    settings = dataclasses.replace(settings, out=str(target))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = out / f"suite.{suite}.{run}.log"
    start = time.perf_counter()
    with log.open("w") as sink:
        try:
            rc = subprocess.run([python, "-m", module, settings.to_json(), *extra], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, timeout=SUITE_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.perf_counter() - start
    print(f"{suite}, run {run}: {took:.0f} s (log: {log})", flush=True)
    if rc != 0 or not target.exists():
        return {"suite": suite, "seconds": took, "error": f"exit {rc}; see {log}",
                "rows": [{"suite": suite, "scenario": "*", "path": "*", "status": "error",
                          "note": log.read_text()[-1500:]}]}
    data = json.loads(target.read_text())
    target.unlink()
    return {**data, "seconds": took}


def against_plain_engine(rows: list[dict], plain_ms: list[dict]) -> list[dict]:
    """vllm-static's own engine runs its taps at every step, requests or not, so its same-engine ratios miss
    what the taps cost. These rows divide its paths (prefill and decode) by the plain prefill and decode that the
    vllm-generate suite timed at the same size on the default engine (no taps, same compilation), in another
    process of this run."""
    plain = {(b["batch"], b["seq"], name): ms for b in plain_ms for name, ms in b.items() if name.startswith("plain")}
    out = []
    for r in rows:
        key = (r.get("batch"), r.get("seq"), r.get("baseline"))
        if r.get("suite") != "vllm-static" or "path_ms" not in r or key not in plain:
            continue
        out.append({**r, "suite": "vllm-static vs plain engine", "baseline_ms": plain[key],
                    "ratio": r["path_ms"] / plain[key], "min_ratio": None,
                    "note": "baseline: the default engine without taps (vllm-generate suite), another process"})
    return out


def merge_runs(runs: list[list[dict]]) -> list[dict]:
    """One timed row per (suite, scenario, path, baseline, size) over the runs (separate processes): the median of
    the runs' ratios and times, and the runs' ratios themselves (`run_ratios`), whose range is the spread the
    report shows. Rows not timed (refused, not served, failed) are kept from every run, so a run that failed
    where another ran still says so."""
    import statistics

    timed: dict[tuple, list[dict]] = {}
    other = []
    for rows in runs:
        for r in rows:
            if "ratio" in r:
                timed.setdefault(tuple(r.get(k) for k in ("suite", "scenario", "path", "baseline", "batch", "seq")),
                                 []).append(r)
            else:
                other.append(r)
    merged = []
    for group in timed.values():
        row = {**group[0], "run_ratios": [r["ratio"] for r in group]}
        for field in ("ratio", "path_ms", "baseline_ms", "tokens_per_s", "baseline_tokens_per_s"):
            if field in row:
                row[field] = statistics.median(r[field] for r in group)
        mins = [r.get("min_ratio") for r in group]
        row["min_ratio"] = None if None in mins else min(mins)
        merged.append(row)
    return merged + other


def _sizes(text: str) -> tuple[tuple[int, int], ...]:
    try:
        sizes = tuple(tuple(int(n) for n in size.split("x")) for size in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or any(len(s) != 2 or min(s) < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: write sizes as BATCHxLENGTH,..., e.g. 64x32,4x64")
    return sizes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI: small model, one size, one rep, every code path")
    parser.add_argument("--num-gpus", type=int, default=None, help="default: NUM_GPUS, else visible CUDA cards, else 1")
    parser.add_argument("--model", default=None, help="family (built locally), checkpoint folder or cached repo id")
    parser.add_argument("--suites", default=",".join(SUITES))
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per path and size (full: 5)")
    parser.add_argument("--runs", type=int, default=None, help="separate processes per suite, each timing every "
                        "repetition; a cell is the median over runs, shown with their range (full: 2, quick: 1)")
    parser.add_argument("--sizes", type=_sizes, default=(), help="batch x prompt length, e.g. 64x32,8x128 "
                        "(default: the mode's)")
    parser.add_argument("--max-wait", type=float, default=None,
                        help="seconds a suite may spend waiting for other processes to leave the CPUs")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--update-readme", action="store_true", help="rewrite README.md's performance section")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, args.quick)
    settings = B.Settings(model=str(model), quick=args.quick, num_gpus=args.num_gpus or default_num_gpus(),
                          reps=args.reps or (1 if args.quick else 5), warmup=1,
                          max_wait_s=args.max_wait if args.max_wait is not None else (0 if args.quick else 20),
                          out="", chosen_sizes=args.sizes)
    runs = args.runs if args.runs is not None else (1 if args.quick else 2)
    if runs < 1:
        parser.error(f"--runs {runs}: give 1 or more separate runs")
    start, suites, per_run = time.perf_counter(), {}, []
    for run in range(runs):  # run after run, so a slow spell of the machine lands in one run, not in every one
        suites = {suite: run_suite(suite, settings, out, run) for suite in args.suites.split(",") if suite}
        rows = [r for s in suites.values() for r in s["rows"]]
        per_run.append(rows + against_plain_engine(rows, suites.get("vllm-generate", {}).get("baselines_ms", [])))
    meta = {"mode": "quick" if args.quick else "full", "machine": report.machine(), "model": report.model_info(model),
            "num_gpus": settings.num_gpus, "sizes": [list(s) for s in settings.sizes], "reps": settings.reps,
            "runs": runs, "new_tokens": settings.new_tokens,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": time.perf_counter() - start,
            "suites": {k: {x: v[x] for x in v if x != "rows"} for k, v in suites.items()}}
    rows = merge_runs(per_run)
    data = {**meta, "rows": rows}
    (out / "results.json").write_text(json.dumps(data, indent=1))
    (out / "results.md").write_text(report.markdown(data))
    report.chart(out / "results.png", data)
    if args.update_readme:
        report.update_readme(ROOT / "README.md", data)
    errors = [r for r in rows if r.get("status") == "error"]
    print((out / "results.md").read_text())
    print(f"{len(errors)} suites failed; wrote {out}/results.{{json,md,png}} in {meta['seconds']:.0f} s")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
