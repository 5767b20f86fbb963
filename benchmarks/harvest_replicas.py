"""Replicated harvest on Ray: throughput with R=1 and R=2 replicas of one CPU each, and a killed replica's cost.

Each run is its own process: it starts a two-node Ray cluster on 127.0.0.1 (one CPU per node), then harvests the
same prompts (a tiny Llama, eager fp32) four ways, in this order: in this process (no Ray), R=1, R=2, and R=2
with one replica's actor SIGKILLed once the second shard is written. Each replicated figure also has its actor
start-up cost: the wall time of the same call on 8 prompts (actors load the model, then one chunk). Throughput is
tokens / (wall - start-up); scaling efficiency = R2 / (2 x R1); recovery = killed wall - R2 wall. Every
replicated folder, the killed run's included, is compared byte for byte with the in-process one.

    python -m benchmarks.harvest_replicas [--runs 2] [--prompts 3000] [--out FILE]

On a 2-core machine the driver (reading prompts, storing rows, writing shards) and Ray's own processes share the
two cores with the replicas, so R=2 cannot approach 2x here; the figure says what it costs, not what a cluster
gains.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kill_one_replica_after(out: Path, shard: str) -> threading.Thread:
    import psutil

    def watch():
        while True:
            text = (out / "manifest.json").read_text() if (out / "manifest.json").exists() else ""
            replicas = []
            for p in psutil.Process().children(recursive=True):
                try:
                    if "_Replica" in " ".join(p.cmdline()):
                        replicas.append(p)
                except psutil.Error:
                    pass
            if len(replicas) == 2 and shard in text:
                os.kill(replicas[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _same_files(a: Path, b: Path) -> bool:
    """Both folders hold the same files, byte for byte."""
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def one_process(n_prompts: int, out_json: str) -> None:
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False  # keep Ray on 127.0.0.1 (see tests/test_harvest_ray.py)
    import ray
    from ray.cluster_utils import Cluster

    from interp_engine import harvest, load_model
    from interp_engine.tiny import build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="ie-replicas-"))
    try:
        build_tiny_model("llama", work / "model")
        cluster = Cluster()
        for _ in range(2):
            cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1", include_dashboard=False,
                             object_store_memory=100 << 20)
        ray.init(address=cluster.address, _node_ip_address="127.0.0.1", logging_level="WARNING", log_to_driver=False)
        model = load_model(str(work / "model"), backend="eager")
        prompts = [[3 + (7 * i + j) % 490 for j in range(16 + i % 48)] for i in range(n_prompts)]
        tokens = sum(map(len, prompts))
        kw = dict(shard_tokens=20000, chunk_prompts=32, progress=False)

        def timed(name, replicas, chosen=prompts, kill=False):
            out = work / name
            shutil.rmtree(out, ignore_errors=True)
            if kill:
                _kill_one_replica_after(out, '"shard-00001')
            start = time.perf_counter()
            harvest(model, chosen, ["resid_post.1"], out, replicas=replicas, **kw)
            return time.perf_counter() - start

        row = {"tokens": tokens, "in_process_s": timed("local", None)}
        for r in (1, 2):
            row[f"startup_R{r}_s"] = timed(f"s{r}", r, prompts[:8])
            row[f"R{r}_s"] = timed(f"r{r}", r)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the lost-replica warning is the point of this run
            row["R2_killed_s"] = timed("r2k", 2, kill=True)
        row["files_equal_in_process"] = {name: _same_files(work / "local", work / name) for name in ("r1", "r2", "r2k")}
        row["load_average_end"] = os.getloadavg()[0]
        Path(out_json).write_text(json.dumps(row))
        ray.shutdown()
        cluster.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def summarize(rows: list[dict]) -> dict:
    def stat(values):
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    per = []
    for r in rows:
        r1 = r["tokens"] / (r["R1_s"] - r["startup_R1_s"])
        r2 = r["tokens"] / (r["R2_s"] - r["startup_R2_s"])
        per.append({"in_process_tok_s": r["tokens"] / r["in_process_s"], "R1_tok_s": r1, "R2_tok_s": r2,
                    "scaling_efficiency": r2 / (2 * r1), "recovery_s": r["R2_killed_s"] - r["R2_s"],
                    "startup_R2_s": r["startup_R2_s"]})
    return {k: stat([p[k] for p in per]) for k in per[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="separate processes")
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--out", default="out/bench/harvest_replicas.json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        one_process(args.prompts, args.child)
        return
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for run in range(args.runs):
        part = out.with_suffix(f".{run}.json")
        subprocess.run([sys.executable, "-m", "benchmarks.harvest_replicas", "--prompts", str(args.prompts),
                        "--child", str(part)], cwd=ROOT, check=True)
        rows.append(json.loads(part.read_text()))
        part.unlink()
    result = {"runs": rows, "summary": summarize(rows)}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
