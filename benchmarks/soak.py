"""Lifecycle soak: load / capture / shutdown a vLLM model N times in one process and watch for leaks.

    python benchmarks/soak.py --cycles 20

Per cycle it prints the child processes left after shutdown() (the multiprocessing resource tracker excluded: spawn
starts it once per process and reuses it), open file descriptors, resident memory of this process, and
interp_engine's result files in /dev/shm. Cycle 1 pays one-off costs (importing vLLM, torch's thread pools, zmq's
context), so growth is measured from the end of cycle 1 to the end of the last cycle. Bounds (checked, and the
exit status says whether they held):

- children: 0 after every shutdown(): shutdown() reaps the engine core and every worker.
- fds: at most FD_SLACK more than after cycle 1: a leaked socket or pipe per cycle would add >= 1 per cycle.
- RSS: at most RSS_SLACK_MB more than after cycle 1: a leaked engine, table or result (a model of this size
  holds ~10 MB of weights plus a 1 GiB KV cache in the worker, not here) would show per cycle; the slack covers
  allocator fragmentation.
- /dev/shm: no interp_engine result file left.

tests/test_soak.py runs the same cycle 3 times in CI with the same bounds.
"""

import argparse
import asyncio
import gc
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

FD_SLACK = 8
RSS_SLACK_MB = 64.0


def measure() -> dict:
    from interp_engine.backends.vllm.runtime import resource_tracker_pid

    gc.collect()
    me = psutil.Process()
    children = [p for p in me.children(recursive=True) if p.pid != resource_tracker_pid()]
    return {"children": len(children), "fds": me.num_fds(), "rss_mb": round(me.memory_info().rss / 2**20, 1),
            "shm_files": len(glob.glob(f"/dev/shm/interp_engine-{os.getpid()}-*"))}


def cycle(path: str) -> tuple[float, float]:
    """One load / capture / shutdown; returns its seconds and those of shutdown() alone."""
    import torch

    from interp_engine import capture, load_model
    from interp_engine import spec as S

    started = time.perf_counter()
    model = load_model(path, backend="vllm")
    try:
        asyncio.run(model.warmup())
        spec = S.Add("resid_post.1", torch.ones(model.d_model))
        cache = capture(model, ["Hello, world!", "Paris is the capital of"], ["resid_post.0", "z.1", "mlp_act.2"],
                        spec, progress=False)
        assert cache["resid_post.0"].shape[0] == 2
        assert model.runtime.worker_status() == [{"calls": 0, "hooks": 0}]
    finally:
        stopping = time.perf_counter()
        asyncio.run(model.shutdown())
    now = time.perf_counter()
    return now - started, now - stopping


def check(rows: list[dict]) -> list[str]:
    """The bounds that failed (empty when all held)."""
    first, last = rows[0], rows[-1]
    failed = [f"cycle {r['cycle']}: {r['children']} child processes after shutdown()" for r in rows if r["children"]]
    failed += [f"cycle {r['cycle']}: {r['shm_files']} result files left in /dev/shm" for r in rows if r["shm_files"]]
    if last["fds"] - first["fds"] > FD_SLACK:
        failed.append(f"fds grew by {last['fds'] - first['fds']} after cycle 1 (bound {FD_SLACK})")
    if last["rss_mb"] - first["rss_mb"] > RSS_SLACK_MB:
        failed.append(f"RSS grew by {last['rss_mb'] - first['rss_mb']:.1f} MB after cycle 1 (bound {RSS_SLACK_MB})")
    return failed


def soak(path: str, cycles: int, log=print) -> list[dict]:
    start = measure()
    log(json.dumps({"cycle": 0, **start}))
    rows = []
    for i in range(1, cycles + 1):
        seconds, shutdown_s = cycle(path)
        rows.append({"cycle": i, "seconds": round(seconds, 1), "shutdown_s": round(shutdown_s, 2), **measure()})
        log(json.dumps(rows[-1]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: a tiny Llama built here)")
    args = parser.parse_args()
    path = args.model
    if path is None:
        from interp_engine.tiny import build_tiny_model

        path = str(build_tiny_model("llama", Path(tempfile.mkdtemp()) / "llama"))
    rows = soak(path, args.cycles)
    first, last = rows[0], rows[-1]
    failed = check(rows)
    print(json.dumps({"cycles": len(rows), "children_max": max(r["children"] for r in rows),
                      "fds_growth_after_cycle_1": last["fds"] - first["fds"], "fd_bound": FD_SLACK,
                      "rss_growth_mb_after_cycle_1": round(last["rss_mb"] - first["rss_mb"], 1),
                      "rss_bound_mb": RSS_SLACK_MB, "rss_max_mb": max(r["rss_mb"] for r in rows),
                      "ok": not failed, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
