"""Peak resident memory of a harvest at N and 10N prompts: it stays bounded while the input grows.

Each size runs in its own process (peak RSS is per process), reading its prompts from a text file, on the
eager backend (the vLLM backends run the model in another process; there the driver holds the same shard and
chunk buffers). Printed: peak RSS of the whole process, and above what it held once the model was loaded
and had run one chunk. The stated bound on the harvest's own memory is

    4 x (shard_tokens + tokens of one chunk) x bytes per token   (the shard being filled; the one being
                                                                  written: its parts, their concatenation and
                                                                  the file's bytes)
  + 2 x prompts per chunk x longest prompt x bytes per token       (one chunk's padded capture, and its copy)

    python benchmarks/harvest_memory.py [--prompts 2000] [--out out/bench/harvest_memory.json]
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SIZES = dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1024, num_attention_heads=8,
             num_key_value_heads=4)
POINTS = ["resid_post.1", "resid_post.3", "mlp_act.2"]
SHARD_TOKENS, CHUNK, LENGTH = 16384, 256, 64


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def child(model_path: str, prompts_file: str, out: str) -> None:
    import torch

    from interp_engine import capture, harvest, load_model

    model = load_model(model_path, backend="eager", device="cpu")
    with open(prompts_file) as f:
        warm = [next(f).rstrip("\n") for _ in range(CHUNK)]
    capture(model, warm, POINTS, progress=False)  # the model and one chunk's working set, before harvesting
    loaded = _rss_mib()
    h = harvest(model, prompts_file, POINTS, out, shard_tokens=SHARD_TOKENS, chunk_prompts=CHUNK, progress=False)
    per_token = sum(h[0][1][p].numel() for p in POINTS) * torch.finfo(model.dtype).bits // 8
    print(json.dumps({"peak_rss_mib": _rss_mib(), "loaded_rss_mib": loaded, "tokens": h.n_tokens,
                      "prompts": h.n_prompts, "bytes_per_token": per_token}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=2000, help="N; the second run has 10N")
    parser.add_argument("--out", default="out/bench/harvest_memory.json")
    args = parser.parse_args()
    import torch

    from interp_engine.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model("llama", Path(tmp) / "model", overrides=SIZES)
        words = "the quick brown fox jumps over a lazy dog while the city builds a library".split()
        g = torch.Generator().manual_seed(0)
        rows = {}
        for n in (args.prompts, 10 * args.prompts):
            prompts = Path(tmp) / f"prompts{n}.txt"
            with prompts.open("w") as f:
                for _ in range(n):
                    picks = torch.randint(0, len(words), (LENGTH // 2,), generator=g)
                    f.write(" ".join(words[int(i)] for i in picks) + "\n")
            argv = [sys.executable, __file__, "--child", str(path), str(prompts), str(Path(tmp) / f"out{n}")]
            run = subprocess.run(argv, capture_output=True, text=True, check=True)
            rows[n] = json.loads(run.stdout.strip().splitlines()[-1])
    first = next(iter(rows.values()))
    per_chunk_tokens = CHUNK * LENGTH  # an upper bound: prompts here are at most ~LENGTH tokens
    bound = (4 * (SHARD_TOKENS + per_chunk_tokens) + 2 * per_chunk_tokens) * first["bytes_per_token"] / 2**20
    print(f"model: llama {SIZES}, fp32, eager on CPU; points {POINTS} ({first['bytes_per_token']} bytes/token); "
          f"shard_tokens {SHARD_TOKENS}, chunk_prompts {CHUNK}")
    print(f"stated bound on the harvest's own memory: {bound:.0f} MiB above the loaded model")
    print("| prompts | tokens | peak RSS MiB | loaded model MiB | peak above loaded MiB |\n|---|---|---|---|---|")
    for n, row in rows.items():
        print(f"| {n} | {row['tokens']} | {row['peak_rss_mib']:.0f} | {row['loaded_rss_mib']:.0f} | "
              f"{row['peak_rss_mib'] - row['loaded_rss_mib']:.0f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": SIZES, "points": POINTS, "shard_tokens": SHARD_TOKENS, "chunk_prompts": CHUNK,
                               "bound_mib": bound, "runs": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        child(*sys.argv[2:])
    else:
        main()
