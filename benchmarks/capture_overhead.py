"""Overhead of capturing every layer's resid_post, against a plain HF forward, on CPU in fp32.

Paths, all in one process on the same locally built random model and the same token ids:
  hf           plain `AutoModelForCausalLM` forward (sdpa), loaded separately
  hf_ie_module the same plain forward on interp_engine's own module (its sdpa wrapper, no hooks)
  interp_engine `capture(model, ids, ["resid_post.0", ...])`, eager backend
  transformer_lens `TransformerBridge.run_with_cache` filtered to blocks.*.hook_resid_post (if installed)
  nnsight      `with model.trace(ids): layer.output.save()` for every layer (if installed)

Each size warms every path up, then times interleaved repetitions (the order rotates each rep), so machine noise
lands on every path alike; the median is reported.

    python benchmarks/capture_overhead.py [--quick] [--out out/bench/capture_overhead.json]
"""

import argparse
import importlib.metadata
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from interp_engine import capture, load_model
from interp_engine.tiny import build_tiny_model

# ~76M parameters with the ~512-token vocabulary of interp_engine.tiny (almost all of it in the 12 blocks).
FULL_MODEL = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
                  num_key_value_heads=4, max_position_embeddings=512)
FULL_SIZES = [(1, 64), (4, 128), (8, 256)]
QUICK_SIZES = [(2, 32)]
BUSY = 0.25  # share of the CPUs other processes may use before a round waits (and is flagged noisy)


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def hf_path(path: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="sdpa")
    model.eval().requires_grad_(False)

    def run(ids):
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False)

    return model, run


def interp_engine_paths(path: Path, n_layers: int):
    handle = load_model(str(path), backend="eager", device="cpu", dtype="float32", attn_implementation="sdpa")
    module = handle.runtime.load()
    points = [f"resid_post.{i}" for i in range(n_layers)]

    def plain(ids):
        with torch.inference_mode():
            module(input_ids=ids, use_cache=False)

    def run(ids):
        return capture(handle, ids, points, progress=False)[f"resid_post.{n_layers - 1}"]

    return plain, run


def transformer_lens_path(path: Path, n_layers: int):
    from transformer_lens.model_bridge import TransformerBridge

    # The bridge forces eager attention so that patterns are hookable: that cost is part of what a user pays.
    bridge = TransformerBridge.boot_transformers(str(path), device="cpu", dtype=torch.float32)
    names = {f"blocks.{i}.hook_resid_post" for i in range(n_layers)}

    def run(ids):
        with torch.inference_mode():
            _, cache = bridge.run_with_cache(ids, names_filter=lambda name: name in names)
        return cache[f"blocks.{n_layers - 1}.hook_resid_post"]

    return run


def nnsight_path(path: Path):
    try:
        from nnsight import TransformersModel as Model  # LanguageModel is a deprecated alias from 0.8 on
    except ImportError:
        from nnsight import LanguageModel as Model
    model = Model(str(path), task="text-generation", device_map="cpu", dispatch=True, dtype=torch.float32,
                  attn_implementation="sdpa")

    def run(ids):
        saved = []
        # An explicit loop: nnsight 0.8.1 does not hand back a list built by a comprehension inside a trace.
        with torch.inference_mode(), model.trace(ids):
            for layer in model.model.layers:
                saved.append(layer.output.save())
        return saved[-1]

    return run


def build_paths(path: Path, n_layers: int) -> tuple[dict, dict, int]:
    """name -> callable(ids) (returns the last layer's resid_post where it captures), installed peer versions."""
    hf_model, hf = hf_path(path)
    n_params = sum(p.numel() for p in hf_model.parameters())
    hf_ie_module, ie = interp_engine_paths(path, n_layers)
    paths = {"hf": hf, "hf_ie_module": hf_ie_module, "interp_engine": ie}
    peers = {}
    for name, dist, make in (("transformer_lens", "transformer-lens", lambda: transformer_lens_path(path, n_layers)),
                             ("nnsight", "nnsight", lambda: nnsight_path(path))):
        try:
            paths[name] = make()
            peers[name] = version(dist)
        except ImportError as e:
            print(f"{name}: not installed ({e})")
            peers[name] = None
    return paths, peers, n_params


def busy_fraction(interval: float = 0.3) -> float | None:
    """Share of all CPUs busy over `interval` (Linux /proc/stat), measured while this process sleeps."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait
    try:
        t0, i0 = sample()
        time.sleep(interval)
        t1, i1 = sample()
    except OSError:
        return None
    return 1 - (i1 - i0) / max(t1 - t0, 1)


class IdleWaiter:
    """With 2 threads on 2 cores, any other busy process stalls every OpenMP region (~16 ms per op here), so each
    timed round starts on an idle machine where possible, within a total waiting budget for the run."""

    def __init__(self, budget_s: float):
        self.deadline = time.monotonic() + budget_s

    def __call__(self) -> float | None:
        busy = busy_fraction()
        while busy is not None and busy > BUSY and time.monotonic() < self.deadline:
            time.sleep(2)
            busy = busy_fraction()
        return busy


def bench_size(paths: dict, ids: torch.Tensor, reps: int, warmup: int, wait: IdleWaiter) -> dict:
    names = list(paths)
    last = {}
    for name in names:
        for _ in range(warmup):
            last[name] = paths[name](ids)
    times = {name: [] for name in names}
    busy = []
    for rep in range(reps):
        busy.append(wait())
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            start = time.perf_counter()
            paths[name](ids)
            times[name].append((time.perf_counter() - start) * 1e3)
    median = {name: statistics.median(t) for name, t in times.items()}
    fastest = {name: min(t) for name, t in times.items()}
    ref = last["interp_engine"]
    diffs = {name: float((t.float() - ref.float()).abs().max()) for name, t in last.items()
             if isinstance(t, torch.Tensor) and name != "interp_engine"}
    return {"batch": int(ids.shape[0]), "seq": int(ids.shape[1]), "ms": times, "busy_before_rounds": busy,
            "median_ms": median, "ratio_vs_hf": {name: m / median["hf"] for name, m in median.items()},
            "min_ms": fastest, "min_ratio_vs_hf": {name: m / fastest["hf"] for name, m in fastest.items()},
            "last_resid_max_abs_diff_vs_interp_engine": diffs}


def table(results: list[dict], names: list[str], ms_key: str = "median_ms", ratio_key: str = "ratio_vs_hf") -> str:
    head = "| batch x seq | " + " | ".join(f"{n} ms" for n in names) + " | " + \
        " | ".join(f"{n}/hf" for n in names if n != "hf") + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(names) - 1)]
    for r in results:
        ms = " | ".join(f"{r[ms_key][n]:.1f}" for n in names)
        ratio = " | ".join(f"{r[ratio_key][n]:.2f}" for n in names if n != "hf")
        lines.append(f"| {r['batch']}x{r['seq']} | {ms} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/bench/capture_overhead.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, one size, two reps (smoke run)")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per path and size (default 7)")
    parser.add_argument("--max-wait", type=float, default=180.0,
                        help="seconds the whole run may spend waiting for other processes to leave the CPUs")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(0)
    sizes = QUICK_SIZES if args.quick else FULL_SIZES
    reps = args.reps or (2 if args.quick else 7)
    warmup = 1 if args.quick else 2

    with tempfile.TemporaryDirectory(prefix="capture_overhead_") as tmp:
        path = build_tiny_model(args.family, Path(tmp) / "model", overrides=None if args.quick else FULL_MODEL)
        config = json.loads((path / "config.json").read_text())
        n_layers = config.get("num_hidden_layers") or config["n_layer"]
        paths, peers, n_params = build_paths(path, n_layers)
        print(f"model: {args.family}, {n_params / 1e6:.1f}M parameters, {n_layers} layers, "
              f"vocab {config['vocab_size']}; fp32, CPU, {torch.get_num_threads()} threads; peers: {peers}")
        results, wait = [], IdleWaiter(args.max_wait)
        for batch, seq in sizes:
            ids = torch.randint(3, config["vocab_size"], (batch, seq))  # 0..2 are pad/bos/eos
            results.append(bench_size(paths, ids, reps, warmup, wait))
            r = results[-1]
            print(f"  {batch}x{seq}: " + ", ".join(f"{n} {m:.1f} ms" for n, m in r["median_ms"].items()), flush=True)

    names = list(paths)
    print("\nmedian of interleaved reps:\n" + table(results, names))
    noisy = sum(b is not None and b > BUSY for r in results for b in r["busy_before_rounds"])
    if noisy:
        print(f"\nWARNING: {noisy} timed rounds started while other processes kept the CPUs busy; timings are noisy;"
              " the fastest rep of each path is less affected:\n" + table(results, names, "min_ms", "min_ratio_vs_hf"))
    print("\nmax |last resid_post - interp_engine's|:",
          {f"{r['batch']}x{r['seq']}": r["last_resid_max_abs_diff_vs_interp_engine"] for r in results})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": {"family": args.family, "n_params": n_params, "config": config, "dtype": "float32", "device": "cpu"},
        "env": {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "transformers": version("transformers"), "interp_engine": version("interp_engine"), **peers},
        "reps": reps, "warmup": warmup, "noisy_rounds": noisy, "results": results,
    }, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
