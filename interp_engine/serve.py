"""`interp-engine serve PATH --backend vllm|vllm-static [--static-points ...] [--static-writes ...] [--api-key KEY]
[--default-spec FILE] [vLLM server flags]`, or
`python -m interp_engine.serve ...`: vLLM's OpenAI-compatible server with per-request specs and captures
(interp_engine/backends/vllm/server.py). Flags this parser does not know go to vLLM's own server parser."""

import argparse
import json
import sys

from interp_engine.errors import InterpEngineError, SpecError, fix


def parser() -> argparse.ArgumentParser:
    from interp_engine.backends.vllm.serving import Limits

    serve = argparse.ArgumentParser(prog="interp-engine serve", description="vLLM's OpenAI-compatible server with "
                                    "per-request steering and captures (an `interp` object in the request body).",
                                    epilog="Any other flag is vLLM's (vllm serve --help), e.g. --port, --host, "
                                    "--api-key, --max-model-len.")
    serve.add_argument("path", help="a checkpoint folder or a repo id in the local HF cache")
    serve.add_argument("--backend", default="vllm", help="vllm (default) or vllm-static")
    serve.add_argument("--static-points", default=None,
                       help='vllm-static taps (what requests may read): "auto" or "resid_post.10,mlp_out.3"')
    serve.add_argument("--static-writes", default=None,
                       help='vllm-static writes (what requests may steer): "auto" or "resid_post.10,mlp_out.3"')
    serve.add_argument("--num-gpus", type=int, default=1, help="GPUs to shard over (default 1)")
    serve.add_argument("--default-spec", default=None,
                       help="a JSON file of Spec.to_dict(): applied to a request without interp; a request's own "
                            'spec replaces it, "interp": {"spec": null} switches it off')
    serve.add_argument("--max-spec-bytes", type=int, default=Limits.spec_bytes, help="largest request body (bytes)")
    serve.add_argument("--max-ops", type=int, default=Limits.ops, help="most ops in one request's spec")
    serve.add_argument("--max-capture-bytes", type=int, default=Limits.capture_bytes,
                       help="largest captures of one response (bytes)")
    return serve


def main(argv: list[str] | None = None) -> int:
    from interp_engine.backends.vllm.server import serve
    from interp_engine.backends.vllm.serving import Limits
    from interp_engine.cli import listed
    from interp_engine.loading import load_model

    args, vllm_argv = parser().parse_known_args(argv)
    try:
        default = None
        if args.default_spec is not None:
            try:
                with open(args.default_spec) as f:
                    default = json.load(f)
            except (OSError, ValueError) as e:
                raise SpecError(fix(f"--default-spec {args.default_spec}: {e}.",
                                    "pass a JSON file holding Spec.to_dict().")) from None
        taps = {name: listed(value) for name, value in (("static_points", args.static_points),
                                                          ("static_writes", args.static_writes)) if value is not None}
        handle = load_model(args.path, backend=args.backend, num_gpus=args.num_gpus, **taps)
        serve(handle, vllm_argv, {"default": default, "limits": Limits(args.max_spec_bytes, args.max_ops,
                                                                      args.max_capture_bytes)})
    except InterpEngineError as e:
        print(f"interp-engine serve: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
