"""What ends in `interp-engine serve`: a client that hangs up leaves nothing in the workers, nothing outlives a
request, SIGTERM and Ctrl-C leave no child process, and a stopped engine fails requests within the deadline. The
session's one server (`conftest.server`, `tests/servers.py`), stopped here by SIGTERM (this module runs after the
others that use it), then a second one of its own."""

import concurrent.futures
import glob
import http.client
import os
import signal
import socket
import time

import psutil
import pytest

from interp_engine import client
from interp_engine import spec as S
from interp_engine.backends.vllm import wire
from tests.conftest import no_child_survives
from tests.servers import (DEFAULT, KEY, PROMPTS, complete, generated_tokens, health, offline, post, served,
                           vector, worker_status)
from tests.skips import requires

pytestmark = requires("vllm")
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def second_server(tiny_path, tmp_path_factory):
    """A server of its own session (process group), started after the shared one is gone, for what ends it: a
    stuck engine and Ctrl-C (SIGINT to the whole group, as a terminal sends it)."""
    with no_child_survives():
        # Kept up with a dead engine (/health 503) rather than stopped by vLLM: Ctrl-C is what stops it.
        yield from served(str(tiny_path("llama")), tmp_path_factory, env={"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "1"},
                          start_new_session=True)


@pytest.fixture(scope="module")
def api2(second_server):
    return openai.OpenAI(base_url=second_server[1], api_key=KEY, max_retries=0, timeout=120)


def _result_files(server) -> list[str]:
    """The server's result files (`wire.result_path`, named by its pid: a steering job's, made before its first
    request, deleted once answered)."""
    return glob.glob(os.path.join(os.path.dirname(wire.result_path("x")), f"{wire.TAG}-{server[0].pid}-*"))


def _left_nothing(server, connection: http.client.HTTPConnection) -> None:
    """Close the hung-up connection; within 30 s the workers hold no call and no hook, and no file is left."""
    connection.close()
    deadline = time.monotonic() + 30
    while worker_status(server) != [{"calls": 0, "hooks": 0}] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert worker_status(server) == [{"calls": 0, "hooks": 0}]
    assert not _result_files(server)
    time.sleep(0.5)  # had the requests run on, they would have generated more by now


def test_a_client_that_hangs_up_mid_stream_leaves_nothing_behind(server, api, eager):
    spec = S.Add("resid_post.1", vector(5))
    generated = generated_tokens(server)
    body = {"model": server[2], "prompt": PROMPTS, "max_tokens": 100, "temperature": 0.0, "ignore_eos": True,
            "stream": True, **client.extra_body(spec)}
    connection = post(server, body)
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the first token has come
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up, far from the 200 tokens asked
    _left_nothing(server, connection)
    assert generated_tokens(server) - generated < 2 * 100, "vLLM saw no hang-up: the test checked nothing"
    steered, _ = complete(api, server, PROMPTS, spec)
    assert steered == offline(eager, spec)


def test_a_client_that_hangs_up_before_its_response_leaves_nothing_behind(server, api, eager):
    """A non-streaming request that captures, its socket closed while it generates: vLLM cancels it, its table
    leaves the worker, and the next request is served correctly."""
    spec = S.Add("resid_post.1", vector(7))
    generated, asked = generated_tokens(server), 4 * 120
    body = {"model": server[2], "prompt": PROMPTS * 2, "max_tokens": 120, "temperature": 0.0, "ignore_eos": True,
            **client.extra_body(spec, capture=["resid_post.0"])}
    connection = post(server, body)
    deadline = time.monotonic() + 30
    while worker_status(server)[0]["calls"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_status(server)[0]["calls"] == 1, "the request never reached the worker: the test checked nothing"
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up while it generates
    _left_nothing(server, connection)
    assert generated_tokens(server) - generated < asked, "vLLM saw no hang-up: the test checked nothing"
    steered, _ = complete(api, server, PROMPTS, spec)
    assert steered == offline(eager, spec)


def _stream(server, spec, prompts, tokens: int) -> http.client.HTTPConnection:
    """A steered stream on a raw connection, its first token come."""
    connection = post(server, {"model": server[2], "prompt": prompts, "max_tokens": tokens, "temperature": 0.0,
                               "ignore_eos": True, "stream": True, **client.extra_body(spec)})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    connection.response = response
    return connection


def _streamed(api, server, spec) -> list[list[int]]:
    """A steered stream of both prompts through the openai client: each prompt's new tokens."""
    tokens = [[] for _ in PROMPTS]
    for chunk in api.completions.create(model=server[2], prompt=PROMPTS, max_tokens=6, temperature=0.0, stream=True,
                                        extra_body={**client.extra_body(spec), "return_token_ids": True}):
        for choice in chunk.choices:
            tokens[choice.index] += choice.token_ids or []
    return tokens


def test_steering_tables_leave_the_workers_with_their_last_request(server, api, eager):
    """Steering jobs are answered without a round trip, and the workers drop each one's table once the scheduler
    reports the last request carrying it finished (no RPC does). After 12 jobs at once, each of 2 prompts, whole,
    streamed, and one hung up mid-stream, the workers hold no table, and the answers equal offline generate."""
    specs = [S.Add("resid_post.1", vector(20 + i)) for i in range(12)]
    streams = _stream(server, specs[0], PROMPTS, 100), _stream(server, specs[1], PROMPTS, 100)
    deadline = time.monotonic() + 30
    while worker_status(server)[0]["calls"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker_status(server)[0]["calls"] >= 1, "no table while streams ran: the test checked nothing"
    streams[0].sock.shutdown(socket.SHUT_RDWR)  # aborted mid-stream
    streams[0].close()
    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        whole = pool.map(lambda s: complete(api, server, PROMPTS, s)[0], specs[2:8])
        streamed = pool.map(lambda s: _streamed(api, server, s), specs[8:])
        assert list(whole) == [offline(eager, s) for s in specs[2:8]]
        assert list(streamed) == [offline(eager, s) for s in specs[8:]]
    assert streams[1].response.read().endswith(b"data: [DONE]\n\n")
    streams[1].close()
    deadline = time.monotonic() + 30  # the last drop comes with the scheduler's step after the last answer
    while worker_status(server) != [{"calls": 0, "hooks": 0}] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_status(server) == [{"calls": 0, "hooks": 0}]


def test_nothing_outlives_a_request_and_sigterm_leaves_no_child_process(server):
    assert worker_status(server) == [{"calls": 0, "hooks": 0}]
    assert not _result_files(server), "a job's file outlived it"
    process = server[0]
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "the server's engine runs in child processes"
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"the server's children survived SIGTERM: {alive}"


def test_a_stopped_engine_fails_requests_within_the_deadline_and_health_says_so(second_server, api2, eager):
    from interp_engine.backends.vllm.life import STOPPED_S, TICK_S

    steered, _ = complete(api2, second_server, PROMPTS, DEFAULT)
    assert steered == offline(eager, DEFAULT) and health(second_server) == 200
    children = psutil.Process(second_server[0].pid).children(recursive=True)
    for child in children:  # the engine core, and the worker inside it (--distributed-executor-backend uni)
        child.suspend()
    try:
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError):
            complete(api2, second_server, PROMPTS, DEFAULT)
        took = time.monotonic() - start
        assert took < STOPPED_S + TICK_S + 3, took  # the deadline, and some slack for a loaded machine
        assert health(second_server) == 503
        with pytest.raises(openai.InternalServerError):  # a later request fails at once
            complete(api2, second_server, PROMPTS[:1], None)
    finally:
        for child in children:
            child.resume()


def test_ctrl_c_leaves_no_child_process(second_server):
    """After the stopped engine above, resumed: the server kept up (VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), its engine
    marked dead, its processes alive."""
    process = second_server[0]
    children = psutil.Process(process.pid).children(recursive=True)
    assert children and process.poll() is None and health(second_server) == 503
    os.killpg(process.pid, signal.SIGINT)  # the server leads its own group: every process in it gets SIGINT
    assert process.wait(60) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"the server's children survived Ctrl-C: {alive}"
