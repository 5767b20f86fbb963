"""Many calls on one vLLM handle at once (threads, as asyncio.to_thread runs them) against the same calls one
after another, on the same engine and prompts: how much sharing vLLM's batches across calls buys.

Each call steers its own prompt with its own vector (`steer`, one prompt of `--length` tokens), so no two
calls could have been merged by the caller. Both ways run in this process, interleaved, medians of `--reps`.

    python -m benchmarks.concurrent_calls [--backend vllm|vllm-static] [--calls 32] [--length 64] [--quick]
"""

import argparse
import asyncio
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def main() -> None:
    import torch

    from benchmarks import common as B
    from interp_engine import load_model, steer
    from interp_engine import spec as S

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="vllm", choices=["vllm", "vllm-static"])
    parser.add_argument("--calls", type=int, default=32)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small model, 8 calls, 1 rep")
    parser.add_argument("--out", default="out/bench/concurrent_calls.json")
    args = parser.parse_args()
    calls, reps = (8, 1) if args.quick else (args.calls, args.reps)
    path = B.bench_model(args.quick)
    n_layers = json.loads((Path(path) / "config.json").read_text())["num_hidden_layers"]
    point = f"resid_post.{n_layers // 2}"
    extra = {"static_points": [point], "static_writes": [point]} if args.backend == "vllm-static" else {}
    model = load_model(str(path), backend=args.backend, max_model_len=512, **extra)
    asyncio.run(model.warmup())
    prompts = B.prompts(model.d_vocab, calls, args.length)
    g = torch.Generator().manual_seed(0)
    specs = [S.Add(point, torch.randn(model.d_model, generator=g)) for _ in range(calls)]
    one = lambda i: steer(model, [prompts[i]], specs[i], progress=False)  # noqa: E731

    def sequential():
        return [one(i) for i in range(calls)]

    def concurrent():
        with ThreadPoolExecutor(max_workers=calls) as pool:
            return list(pool.map(one, range(calls)))

    try:
        # Each call's logits must not depend on which other calls shared its batches.
        same = all(torch.equal(a, b) for a, b in zip(sequential(), concurrent()))
        times = {"sequential": [], "concurrent": []}
        for rep in range(reps):
            for name in (("sequential", "concurrent") if rep % 2 == 0 else ("concurrent", "sequential")):
                start = time.perf_counter()
                (sequential if name == "sequential" else concurrent)()
                times[name].append(time.perf_counter() - start)
    finally:
        asyncio.run(model.shutdown())
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"backend": args.backend, "calls": calls, "length": args.length, "model": str(path),
              "bit_identical": same, "seconds": times, "speedup": med["sequential"] / med["concurrent"]}
    print(f"{calls} steer calls of 1x{args.length} on {args.backend} ({path.name}): sequential "
          f"{med['sequential']:.2f} s, concurrent {med['concurrent']:.2f} s, speedup {result['speedup']:.2f}x; "
          f"each call's logits bit-identical either way: {same}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
