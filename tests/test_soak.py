"""Lifecycle soak, short: 2 load / capture / shutdown cycles (each later one against the first) on vLLM with no growth in child processes, file
descriptors or resident memory beyond the bounds stated (and justified) in benchmarks/soak.py, which runs 20.

The cycles run in a fresh process (benchmarks/soak.py itself), so the figures are this library's alone: inside
a pytest process that already ran module-scoped vLLM fixtures, each later load was seen to keep 9 descriptors
(zmq event fds and pipes); see the README's Reliability section."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.soak import FD_SLACK, RSS_SLACK_MB
from tests.skips import requires

CYCLES = 2  # CI time: each cycle is an engine start; benchmarks/soak.py runs 20
ROOT = Path(__file__).resolve().parents[1]


@requires("vllm")
def test_load_capture_shutdown_cycles_leak_nothing(tiny_path):
    # A temp folder of its own (short: a socket's path has at most 107 bytes): vLLM binds its ZMQ sockets at
    # named paths under it and leaves the files behind, unless the engine's own socket folder (engine.SOCKETS)
    # is removed at shutdown.
    with tempfile.TemporaryDirectory(prefix="soak-") as temp:
        out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "soak.py"), "--cycles", str(CYCLES),
                              "--model", str(tiny_path("llama"))], capture_output=True, text=True, timeout=900,
                             env={**os.environ, "TMPDIR": temp})
        sockets = [p for p in Path(temp).rglob("*") if p.is_socket()]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows, summary = [r for r in lines if "cycle" in r and r["cycle"] > 0], lines[-1]
    for row in rows:
        print(f"[soak] {row}")
    print(f"[soak] {summary}")
    assert len(rows) == CYCLES, out.stderr[-3000:]
    assert summary["fd_bound"] == FD_SLACK and summary["rss_bound_mb"] == RSS_SLACK_MB
    assert summary["ok"], summary["failed"]
    assert out.returncode == 0
    assert not sockets, f"shutdown() left vLLM's socket files: {sockets}"
