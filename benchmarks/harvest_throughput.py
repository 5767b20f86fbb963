"""Harvest tokens/s against plain vLLM prefill tokens/s (max_tokens=1) on the same prompts.

The baseline is an untouched vLLM engine (backend="vllm-generate": no extension, vLLM's default compilation),
loaded in this process first with the same settings, timed, and shut down. With --backend vllm the same
engine's own plain prefill (enforce_eager, as that backend needs) is timed as well, which isolates what
harvesting costs from what enforce_eager costs. Harvest runs write real files (a temp folder per rep).

The harvest is timed at each `--depths` value: how many chunks the stream keeps in the engine at once (the
runtime's STREAM_DEPTH). Depth 1 is one chunk at a time, each draining vLLM's batch before the next is queued;
depth 2 (the library's) queues the next chunk behind the one being finished.

    python benchmarks/harvest_throughput.py                      # backend vllm-static, static_points = points
    python benchmarks/harvest_throughput.py --backend vllm [--quick] [--out out/bench/harvest_throughput.json]
"""

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def _prefill(llm, prompts) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                 SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, skip_reading_prefix_cache=True),
                 use_tqdm=False)


def _timed(fn, reps: int) -> list[float]:
    fn()  # warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    import torch

    from interp_engine import harvest, load_model
    from interp_engine.backends.vllm import runtime
    from interp_engine.tiny import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="vllm-static", choices=["vllm-static", "vllm"])
    parser.add_argument("--points", default=None, help="comma-separated (default: resid_post at the middle layer)")
    parser.add_argument("--prompts", type=int, default=1024)
    parser.add_argument("--chunk-prompts", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--depths", default="1,2", help="comma-separated stream depths to time (default: 1,2)")
    parser.add_argument("--quick", action="store_true", help="small model, 256 prompts, 2 reps")
    parser.add_argument("--out", default="out/bench/harvest_throughput.json")
    args = parser.parse_args()
    sizes = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2) if args.quick else \
        dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1536, num_attention_heads=8,
             num_key_value_heads=4)
    n_prompts, reps = (256, 2) if args.quick else (args.prompts, args.reps)
    depths, library_depth = [int(d) for d in args.depths.split(",")], runtime.STREAM_DEPTH
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("llama", Path(tmp) / "model", overrides={**sizes, "max_position_embeddings": 512})
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(32, 129, (n_prompts,), generator=gen).tolist()
        prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lengths]
        tokens = sum(lengths)
        settings = dict(max_model_len=512)

        plain = load_model(str(path), backend="vllm-generate", **settings)
        asyncio.run(plain.warmup())
        params = sum(p.numel() for p in _weights(path))
        baseline = _timed(lambda: _prefill(plain.runtime.llm, prompts), reps)
        asyncio.run(plain.shutdown())

        middle = sizes["num_hidden_layers"] // 2
        points = args.points.split(",") if args.points else [f"resid_post.{middle}"]
        extra = {"static_points": points} if args.backend == "vllm-static" else {}
        model = load_model(str(path), backend=args.backend, **settings, **extra)
        asyncio.run(model.warmup())
        counter = iter(range(10**6))

        def run():
            harvest(model, prompts, points, Path(tmp) / f"out{next(counter)}", chunk_prompts=args.chunk_prompts,
                    progress=False)

        harvested = {}
        for depth in depths:
            runtime.STREAM_DEPTH = depth
            harvested[depth] = _timed(run, reps)
        runtime.STREAM_DEPTH = library_depth
        same_engine = _timed(lambda: _prefill(model.runtime.llm, prompts), reps) if args.backend == "vllm" else None
        asyncio.run(model.shutdown())

    rate = lambda times: tokens / statistics.median(times)  # noqa: E731
    result = {
        "model": {"family": "llama", **sizes, "parameters": params}, "prompts": n_prompts, "tokens": tokens,
        "points": points, "backend": args.backend, "chunk_prompts": args.chunk_prompts,
        "plain_prefill_tok_s": rate(baseline), "library_depth": library_depth,
        "harvest_tok_s": {d: rate(t) for d, t in harvested.items()},
        "ratio": {d: rate(t) / rate(baseline) for d, t in harvested.items()},
        "reps_s": {"plain_prefill": baseline, **{f"harvest_depth_{d}": t for d, t in harvested.items()}},
    }
    if same_engine is not None:
        result["same_engine_prefill_tok_s"] = rate(same_engine)
        result["ratio_vs_same_engine"] = {d: rate(t) / rate(same_engine) for d, t in harvested.items()}
        result["reps_s"]["same_engine_prefill"] = same_engine
    print(f"model: llama {sizes} ({params / 1e6:.1f}M parameters), {n_prompts} prompts, {tokens} tokens, fp32, "
          f"{platform.processor() or platform.machine()}")
    print("| path | tokens/s | ratio |\n|---|---|---|")
    print(f"| plain vLLM prefill (vllm-generate engine) | {result['plain_prefill_tok_s']:.0f} | 1.00 |")
    if same_engine is not None:
        print(f"| plain prefill on the harvest's engine (enforce_eager) | {result['same_engine_prefill_tok_s']:.0f} | "
              f"{result['same_engine_prefill_tok_s'] / result['plain_prefill_tok_s']:.2f} |")
    for d in depths:
        which = " (the library's)" if d == library_depth else ""
        print(f"| harvest {','.join(points)} on {args.backend}, {d} chunk(s) in the engine{which} | "
              f"{result['harvest_tok_s'][d]:.0f} | {result['ratio'][d]:.2f} |")
        if same_engine is not None:
            print(f"harvest at depth {d} / same-engine prefill: {result['ratio_vs_same_engine'][d]:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def _weights(path: Path):
    from safetensors.torch import load_file

    return [t for f in sorted(path.glob("*.safetensors")) for t in load_file(f).values()]


if __name__ == "__main__":
    main()
