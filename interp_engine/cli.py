"""The `interp-engine` command.

`interp-engine size REPO_OR_PATH ...` runs the GPU sizer on config.json alone. Exit status: 0 when it fits, 1
when it does not, 2 for bad input (the error says the fix).

`interp-engine harvest MODEL --points resid_post.10 --prompts FILE --out DIR` streams activations to sharded
safetensors files (interp_engine.harvest); rerun it to resume. With `--format saelens --context-size N` it writes
the `datasets` folder SAELens trains from instead. Exit status: 0 done, 2 bad input.

`interp-engine serve PATH --backend vllm ...` runs vLLM's OpenAI-compatible server with per-request specs and
captures (interp_engine.serve).
"""

import argparse
import sys

from interp_engine.errors import InterpEngineError


def _parser() -> argparse.ArgumentParser:
    from interp_engine.sizing import GPUS_MIB, KV_CACHE_DTYPES

    parser = argparse.ArgumentParser(prog="interp-engine", description="Mechanistic interpretability tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    size = commands.add_parser(
        "size", help="price a load_model call on a GPU from config.json alone",
        description="Price weights, KV cache, capture buffers and overhead per GPU from config.json alone (no "
                    "weights, no network), say whether it fits, and print the load_model call priced.",
        epilog="exit status: 0 fits, 1 does not fit, 2 bad input")
    size.add_argument("repo_or_path", help="a checkpoint folder, a config.json, or a repo id in the local HF cache")
    size.add_argument("--backend", default="vllm", help="vllm (default), vllm-static, vllm-generate or eager")
    size.add_argument("--quantization", default=None, help="fp8, bnb-4bit, bnb-8bit or none (default)")
    size.add_argument("--kv-cache-dtype", default=None, help=f"one of {', '.join(KV_CACHE_DTYPES)} (default auto)")
    size.add_argument("--num-gpus", type=int, default=1, help="GPUs to shard over (default 1)")
    size.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    size.add_argument("--concurrency", type=int, default=1, help="sequences of max-model-len at once (default 1)")
    size.add_argument("--static-points", default=None, help='vllm-static taps: "auto" or "resid_post.10,mlp_out.3"')
    size.add_argument("--static-writes", default=None, help='vllm-static writes: "auto" or "resid_post.10,mlp_out.3"')
    size.add_argument("--gpu", default="H100-80GB", help=f"one of {', '.join(GPUS_MIB)} (default H100-80GB)")
    size.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU to use (0.9)")
    size.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    _harvest_parser(commands)
    return parser


def _harvest_parser(commands) -> None:
    harvest = commands.add_parser(
        "harvest", help="capture activations on many prompts into sharded safetensors files",
        description="Capture activations at the points on every prompt and stream them to sharded safetensors "
                    "files with a JSON manifest. Rerunning the same command resumes an interrupted run.",
        epilog="exit status: 0 done, 2 bad input")
    harvest.add_argument("model", help="a checkpoint folder or a HF repo id (downloaded when not in the local HF cache)")
    harvest.add_argument("--points", required=True,
                         help='comma-separated, ours or TransformerLens names: "resid_post.10,blocks.3.hook_mlp_out"')
    harvest.add_argument("--prompts", required=True, help="a text file (one prompt per line) or a .jsonl file")
    harvest.add_argument("--field", default="text", help="the JSONL field holding each prompt (default text)")
    harvest.add_argument("--out", required=True, help="output folder (new, empty, or an unfinished harvest)")
    harvest.add_argument("--backend", default="auto", help="auto (default), vllm, vllm-static or eager")
    harvest.add_argument("--device", default=None, help="eager: cpu, cuda, mps (default: the best available)")
    harvest.add_argument("--model-dtype", default="auto", help="dtype the model runs in (default auto)")
    harvest.add_argument("--dtype", default=None, help="dtype of the stored activations (default: the model's)")
    harvest.add_argument("--shard-tokens", type=int, default=65536, help="tokens per shard, at least (65536)")
    harvest.add_argument("--chunk-prompts", type=int, default=256, help="prompts per capture call (256)")
    harvest.add_argument("--replicas", type=int, default=None,
                         help="engines harvesting in parallel as Ray actors (RAY_ADDRESS's cluster, else a local one)")
    harvest.add_argument("--format", default="safetensors", choices=("safetensors", "saelens"),
                         help="safetensors shards (default) or saelens: the datasets folder SAELens's "
                              "cached_activations_path reads (needs --context-size)")
    harvest.add_argument("--context-size", type=int, default=None, help="saelens: tokens per row (SAELens's "
                                                                         "context_size)")
    harvest.add_argument("--no-progress", action="store_true", help="no progress bar")


def _harvest(args) -> int:
    import asyncio

    from interp_engine.harvest import harvest
    from interp_engine.loading import load_model

    from interp_engine.backends import REGISTRY

    points = [p.strip() for p in args.points.split(",") if p.strip()]
    declares = args.backend in REGISTRY and REGISTRY[args.backend].declares_taps  # the taps come first there
    keywords = {"static_points": points} if declares else {}
    try:
        model = load_model(args.model, backend=args.backend, device=args.device, dtype=args.model_dtype, **keywords)
    except InterpEngineError as e:
        print(f"interp-engine harvest: {e}", file=sys.stderr)
        return 2
    try:
        done = harvest(model, args.prompts, points, args.out, shard_tokens=args.shard_tokens, dtype=args.dtype,
                       chunk_prompts=args.chunk_prompts, field=args.field, progress=not args.no_progress,
                       replicas=args.replicas, format=args.format, context_size=args.context_size)
    except InterpEngineError as e:
        print(f"interp-engine harvest: {e}", file=sys.stderr)
        return 2
    finally:
        asyncio.run(model.shutdown())
    print(f"{done!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its own parser: every flag it does not know is vLLM's (interp_engine/serve.py)
        from interp_engine.serve import main as serve

        return serve(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "harvest":
        return _harvest(args)
    from interp_engine.sizing import estimate

    points, writes = (listed(value) for value in (args.static_points, args.static_writes))
    quantization = None if str(args.quantization).lower() == "none" else args.quantization
    try:
        result = estimate(args.repo_or_path, backend=args.backend, quantization=quantization,
                          kv_cache_dtype=args.kv_cache_dtype, num_gpus=args.num_gpus, max_model_len=args.max_model_len,
                          concurrency=args.concurrency, static_points=points, static_writes=writes, gpu=args.gpu,
                          gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype)
    except InterpEngineError as e:
        print(f"interp-engine size: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.fits else 1


def listed(value: str | None) -> str | list[str] | None:
    """`"auto"`, None, or a comma-separated list of points."""
    if value is None or value == "auto":
        return value
    return [p.strip() for p in value.split(",") if p.strip()]


if __name__ == "__main__":
    sys.exit(main())
