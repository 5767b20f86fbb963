"""Does a server slow down over its lifetime? Plain `vllm serve` and `interp-engine serve` (each request steering
with its client's own vector), both started once and kept up, then rounds of N concurrent clients
(`benchmarks/serve.py`'s model, prompts, vectors and engine settings; N cycles through `--clients`), each round
run against both servers back to back, the order alternating. Per round and server: generated tokens per second,
the CPU time per request of the API server process and of its engine's processes (CPU time: a loaded machine does
not fool it as a clock does), and the cores the machine's other processes used meanwhile. A server holding state
that grows with the requests served shows as CPU per request, or a ratio to plain, that moves from round to
round of the same N.

    python -m benchmarks.serve_drift [--rounds 9] [--clients 32,1,8] [--requests 4] [--out FILE]
"""

import argparse
import json
import tempfile
from pathlib import Path

import psutil

from benchmarks import common as B
from benchmarks import serve


def main() -> None:
    serve.stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clients", default="32,1,8", help="clients per round, cycled")
    parser.add_argument("--requests", type=int, default=4, help="per client per round")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    sizes = [int(c) for c in args.clients.split(",")]
    model = B.bench_model(False)
    bodies = {kind: serve.bodies_of(model, kind, max(sizes), B.FULL_NEW_TOKENS, 0) for kind in serve.KINDS}
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-drift-"))
    servers: dict[str, serve.Server] = {}
    rows, served = [], {kind: max(sizes) for kind in serve.KINDS}
    try:
        for kind in serve.KINDS:
            servers[kind] = serve.Server(kind, model, logs / f"{kind}.log")
        every = tuple(servers.values())
        for kind, server in servers.items():
            serve._load(server, bodies[kind], 1, every)  # the first batch's allocations
        for r in range(args.rounds):
            n = sizes[r % len(sizes)]
            row = {"round": r, "clients": n}
            for kind in serve.KINDS if r % 2 == 0 else serve.KINDS[::-1]:
                process = psutil.Process(servers[kind].process.pid)
                own, engine = process.cpu_times(), serve._cpu_s([process])
                measured = serve._load(servers[kind], bodies[kind][:n], args.requests, every)
                after = process.cpu_times()
                own_s = after.user + after.system - own.user - own.system
                requests = measured["requests"]
                row[kind] = {"tokens_per_s": measured["tokens_per_s"], "p50_ms": measured["p50_ms"],
                             "server_cpu_ms_per_request": 1e3 * own_s / requests,
                             "engine_cpu_ms_per_request": 1e3 * (serve._cpu_s([process]) - engine - own_s) / requests,
                             "other_processes_cores": measured["other_processes_cores"]}
                served[kind] += requests
            row["served_after"] = served["interp"]
            row["ratio"] = row["interp"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
            rows.append(row)
            print(f"round {r} {n:2} clients, {served['interp']:4} served: ratio {row['ratio']:.3f}; " + "; ".join(
                f"{k} {row[k]['tokens_per_s']:6.1f} tok/s, CPU ms/request server "
                f"{row[k]['server_cpu_ms_per_request']:.2f} engine {row[k]['engine_cpu_ms_per_request']:.1f}, "
                f"other processes {row[k]['other_processes_cores']:.2f} cores" for k in serve.KINDS), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"model": str(model), "requests_per_client": args.requests,
                                              "env": B.env_info(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
