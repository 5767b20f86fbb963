"""The `interp-engine` command. `interp-engine size REPO_OR_PATH ...` runs the GPU sizer on config.json alone.

Exit status of `size`: 0 when it fits, 1 when it does not, 2 for bad input (the error says the fix).
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
    size.add_argument("--gpu", default="H100-80GB", help=f"one of {', '.join(GPUS_MIB)} (default H100-80GB)")
    size.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of each GPU to use (0.9)")
    size.add_argument("--dtype", default="auto", help="auto (the checkpoint's), bfloat16, float16 or float32")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from interp_engine.sizing import estimate

    points = args.static_points
    if points is not None and points != "auto":
        points = [p.strip() for p in points.split(",") if p.strip()]
    quantization = None if str(args.quantization).lower() == "none" else args.quantization
    try:
        result = estimate(args.repo_or_path, backend=args.backend, quantization=quantization,
                          kv_cache_dtype=args.kv_cache_dtype, num_gpus=args.num_gpus, max_model_len=args.max_model_len,
                          concurrency=args.concurrency, static_points=points, gpu=args.gpu,
                          gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype)
    except InterpEngineError as e:
        print(f"interp-engine size: {e}", file=sys.stderr)
        return 2
    print(result.report())
    return 0 if result.fits else 1


if __name__ == "__main__":
    sys.exit(main())
