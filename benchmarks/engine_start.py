"""Engine start: interp_engine's `vllm` load against vLLM's own `LLM(...)` of the same engine, in one process.

Four ways to start the same engine (the tiny Llama by default, enforce_eager, the same keyword arguments and
environment), alternated for --rounds rounds: `plain` is `LLM(**kwargs)` without our worker extension,
`no_plugins` the same with VLLM_PLUGINS="" (no general plugin loaded in the engine's processes), `extension`
adds it (its import-time work in every worker: compat_modules.keep_cpu_weights, experts.keep_plain_weights), and
`ours` is `load_model(...).runtime.load()` (the extension plus the driver's side: settings, the watchdog, the
orphan guard, socket folders). Each start is followed by its shutdown, also timed; `ours` also times its first
call (`first_call_s`: the workers attach, the result arena is made). Prints one JSON line per start and a summary.

    python -m benchmarks.engine_start [--rounds 2] [--model FOLDER]
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path


def _plain(path: str, extension: bool, plugins: bool = True) -> dict:
    import psutil

    from interp_engine import load_model
    from interp_engine.backends.vllm import compat, engine
    from interp_engine.backends.vllm.procs import close_children, environ, exited
    from interp_engine.backends.vllm.runtime import resource_tracker_pid

    runtime = load_model(path, backend="vllm").runtime  # lazy: reads the config and tokenizer only
    kwargs, env = engine.settings(runtime)
    if not extension:
        kwargs.pop("worker_extension_cls")
    if not plugins:  # vLLM loads every installed general plugin (vllm-bnb-plugin here) in each of its processes
        env["VLLM_PLUGINS"] = ""
    from vllm import LLM

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.perf_counter()
    with environ(env):
        llm = LLM(**kwargs)
    up = time.perf_counter()
    procs = [p for p in psutil.Process().children(recursive=True)
             if p.pid not in before and p.pid != resource_tracker_pid()]
    compat.shutdown(llm)
    del llm
    close_children({p.pid for p in procs}, 20)
    for p in exited(procs, 20):
        p.kill()
    engine.remove_sockets(env.get(engine.SOCKETS))
    return {"start_s": up - started, "shutdown_s": time.perf_counter() - up}


def _ours(path: str) -> dict:
    from interp_engine import capture, load_model

    started = time.perf_counter()
    model = load_model(path, backend="vllm")
    asyncio.run(model.warmup())
    up = time.perf_counter()
    capture(model, ["Hello, world!"], ["resid_post.0"], progress=False)
    first = time.perf_counter()
    asyncio.run(model.shutdown())
    return {"start_s": up - started, "first_call_s": first - up, "shutdown_s": time.perf_counter() - first}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default=None, help="a checkpoint folder (default: a tiny Llama, built here)")
    args = parser.parse_args()
    path = args.model
    if path is None:
        from interp_engine.tiny import build_tiny_model

        path = str(build_tiny_model("llama", Path(tempfile.mkdtemp(prefix="engine-start-")) / "llama"))
    runs = {"plain": lambda: _plain(path, False), "extension": lambda: _plain(path, True), "ours": lambda: _ours(path),
            "no_plugins": lambda: _plain(path, False, plugins=False)}
    got: dict[str, list[dict]] = {name: [] for name in runs}
    _plain(path, False)  # imports vLLM and warms the OS's file cache: not counted
    for i in range(args.rounds):
        for name, run in (runs.items() if i % 2 == 0 else reversed(runs.items())):
            row = run()
            got[name].append(row)
            print(json.dumps({"round": i, "how": name, **{k: round(v, 2) for k, v in row.items()}}), flush=True)
    summary = {name: {k: {"median": round(statistics.median(r[k] for r in rows), 2),
                          "min": round(min(r[k] for r in rows), 2), "max": round(max(r[k] for r in rows), 2)}
                      for k in rows[0]} for name, rows in got.items()}
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
