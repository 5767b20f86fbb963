"""An engine's life on vLLM (life.py, guard.py): faults that leave the processes up (a stopped process, a dead
input loop), Ctrl-C at random moments, shutdown() under running calls, and the driver killed outright.

Each ends in a clear error or a clean state within a stated deadline, never a hang; the measured times are
printed (`pytest -s`) and quoted in the README's Reliability section.
"""

import asyncio
import os
import queue
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from interp_engine import BackendError, capture, load_model
from interp_engine.backends.vllm import compat, life
from interp_engine.backends.vllm.runtime import resource_tracker_pid
from tests.conftest import PROMPTS
from tests.skips import requires

ROOT = Path(__file__).resolve().parents[1]
SLACK_S = 10.0  # on top of each stated deadline: a loaded 2-core machine
ORPHANS_GONE_S = 15.0
LONG = [" ".join([p] * 4) for p in PROMPTS] * 16


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)} - {resource_tracker_pid()}


def _error_during_captures(model, fault) -> tuple[BaseException, float]:
    """Run long captures, inject `fault()` once one is under way; the error and seconds from fault to error."""
    at: list[float] = []
    started = threading.Event()

    def inject():
        started.wait()
        time.sleep(0.5)
        at.append(time.monotonic())
        fault()

    threading.Thread(target=inject, daemon=True).start()
    with pytest.raises(BackendError) as info:
        for _ in range(10_000):
            started.set()
            capture(model, LONG, ["resid_post.0", "z.1"], progress=False)
    return info.value, time.monotonic() - at[0]


def _shut(model, before: set[int]) -> None:
    asyncio.run(model.shutdown())
    assert _children() <= before, "shutdown() left a child process"


@pytest.fixture(scope="module")
def llama(tiny_path):
    """(one handle on the tiny Llama, the child processes before its engine) for the in-process tests below, in
    an order that saves engine starts: a test that breaks the engine shuts it down and the next one's first call
    loads a fresh one (as documented); one that leaves it whole hands it on (3 starts here rather than 5)."""
    before = _children()
    model = load_model(str(tiny_path("llama")), backend="vllm")
    yield model, before
    _shut(model, before)


@requires("vllm")
def test_shutdown_under_running_calls_fails_them_promptly_and_starts_no_engine(llama):
    model, before = llama
    model.runtime.load()
    engine = set(p.pid for p in model.runtime._procs)
    outcomes: list = []
    go = threading.Barrier(5)

    stop = threading.Event()  # a call made after shutdown() loads afresh (documented): none is begun after it
    def call():
        go.wait()
        try:
            while not stop.is_set():
                capture(model, LONG, ["resid_post.0"], progress=False)
        except BaseException as e:  # noqa: BLE001 - the test records what each caller got
            outcomes.append((e, time.monotonic()))

    threads = [threading.Thread(target=call, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    go.wait()
    time.sleep(2.0)
    stop.set()  # callers are inside their calls nearly all the time: each of those must fail, none loads again
    started = time.monotonic()
    asyncio.run(model.shutdown())
    shut = time.monotonic()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a call still hangs 30 s after shutdown()"
    assert model.runtime.llm is None, "a call in flight started a new engine"
    assert _children() <= before, "a call in flight started new processes"
    assert not (engine & _children())
    for error, _ in outcomes:
        assert isinstance(error, BackendError) and "was shut down" in str(error), repr(error)
    latest = max(at for _, at in outcomes) - started
    print(f"\n[life] shutdown(): took {shut - started:.2f} s; last of 4 calls failed {latest:.2f} s after it began")
    # A call made after shutdown() loads afresh (documented): that engine is whole, and the next test takes it.
    assert capture(model, PROMPTS, ["resid_post.0"], progress=False)["resid_post.0"].shape[0] == len(PROMPTS)
    assert model.runtime.llm is not None and not (engine & _children())


@requires("vllm")
def test_ctrl_c_inside_an_engine_wait_lands_after_it(llama, monkeypatch):
    """A KeyboardInterrupt inside vLLM's wait for the engine (queue.get in a step, Future.result in an RPC: both
    a Condition's wait) can leave the lock released and become "RuntimeError: release unlocked lock" (a CI run
    lost its driver so, once in some 300 interrupts). So the driver holds Ctrl-C back for each step and RPC: a
    real SIGINT sent inside one raises only once it returned, and the engine goes on whole."""
    points = ["resid_post.0", "mlp_act.1"]
    model, _ = llama
    expected = capture(model, PROMPTS, points, progress=False)
    llm, events = model.runtime.llm, []

    def inside(wait):
        def waiting(*args, **kwargs):
            if not events:  # the first wait of the call: Ctrl-C now, while it waits
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # Python's handler would have raised by now
                events.append("signalled")
            answer = wait(*args, **kwargs)
            events.append("returned")
            return answer
        return waiting

    for where, call in (("step", lambda: capture(model, PROMPTS, points, progress=False)),
                        ("collective_rpc", model.runtime.worker_status)):
        events.clear()
        with monkeypatch.context() as patch:
            if where == "step":
                patch.setattr(compat, "step", inside(compat.step))
            else:
                patch.setattr(llm, "collective_rpc", inside(llm.collective_rpc))
            with pytest.raises(KeyboardInterrupt):
                call()
        assert events == ["signalled", "returned"], f"{where}: {events}"
        got = capture(model, PROMPTS, points, progress=False)
        assert all(torch.equal(got[k], expected[k]) for k in expected), where
        assert llm.llm_engine.get_num_unfinished_requests() == 0, where
        [status] = model.runtime.worker_status()
        assert status["calls"] == 0 and status["hooks"] == 0, (where, status)


@requires("vllm")
def test_a_stopped_worker_is_a_backend_error_within_the_deadline(llama):
    model, before = llama
    capture(model, PROMPTS, ["resid_post.0"], progress=False)
    victim = next(p for p in map(psutil.Process, (q.pid for q in model.runtime._procs)) if p.name() == "VLLM::Worker")
    try:
        error, elapsed = _error_during_captures(model, lambda: victim.suspend())
        print(f"\n[life] stopped worker: BackendError {elapsed:.2f} s after SIGSTOP (deadline {life.STOPPED_S} s)")
        assert "stopped (SIGSTOP)" in str(error) and "Fix: await model.shutdown()" in str(error), str(error)
        assert elapsed < life.STOPPED_S + SLACK_S
        with pytest.raises(BackendError, match="has died"):
            capture(model, PROMPTS, ["resid_post.0"], progress=False)
    finally:
        _shut(model, before)  # SIGKILL reaches a stopped process


@requires("vllm")
def test_a_dead_engine_input_loop_is_a_backend_error_within_the_deadline(llama):
    model, before = llama
    model.runtime.load()
    core = model.runtime.llm.llm_engine.engine_core

    def corrupt():  # the bytes a half-sent message leaves: the core's input thread dies decoding them
        with model.runtime._life.send_lock:
            core.input_socket.send_multipart((core.core_engine, b"\x00\x00"))

    try:
        error, elapsed = _error_during_captures(model, corrupt)
        print(f"\n[life] dead input loop: BackendError {elapsed:.2f} s after the corrupt message (deadline "
              f"{life.PROBE_EVERY_S + life.PROTOCOL_S} s)")
        assert "stopped answering" in str(error), str(error)
        assert elapsed < life.PROBE_EVERY_S + life.PROTOCOL_S + SLACK_S
        assert all(p.is_running() for p in model.runtime._procs), "the processes were meant to live on"
    finally:
        _shut(model, before)


WORDS = {"pids", "first", "go", "ok", "bad", "closed", "error"}  # the driver's own lines; vLLM logs to the same stdout


class _Driver:
    """tests/engine_driver.py in a subprocess, its protocol lines read by a thread (a select() on the pipe
    would miss lines already in the reader's buffer)."""

    def __init__(self, mode: str, folder, *args):
        self.stderr = tempfile.TemporaryFile("w+")  # shown when a line differs: why the driver said it
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.engine_driver", mode, str(folder), *map(str, args)], cwd=ROOT,
            stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.split()[:1] and line.split()[0] in WORDS:
                self.lines.put(line.split())
        self.lines.put(["exited"])

    def line(self, timeout: float = 300.0) -> list[str]:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the driver said nothing for {timeout} s{self.errors()}") from None

    def errors(self) -> str:
        """The end of the driver's stderr (vLLM's log and any traceback), for a failure's message."""
        self.stderr.seek(0)
        return "\n--- the driver's stderr, last 4000 characters:\n" + self.stderr.read()[-4000:]

    def pids(self) -> list[psutil.Process]:
        """The engine's processes; `first` is what the driver said of its first call (engine_driver.first_call)."""
        words, self.first = self.line(), self.line()
        assert words[0] == "pids", words
        return [psutil.Process(int(pid)) for pid in words[1:]]


@pytest.fixture(scope="module")
def idle_driver(tiny_path):
    driver = _Driver("idle", tiny_path("llama"))
    try:
        yield driver, driver.pids()
    finally:
        driver.process.kill()


@requires("vllm")
def test_the_call_that_loads_the_engine_frees_its_result_once_dropped(idle_driver):
    driver, _ = idle_driver
    assert driver.first == ["first", "freed"], f"the first call's result outlived its caller{driver.errors()}"


# `interp-engine serve` in a fresh process, refused by vLLM's own parser once vLLM is imported: the handle it
# loaded must die with the call (vLLM's import once kept the calling frames, `handle` among their locals).
SERVE_REFUSED = """
import gc, sys, weakref
from interp_engine import loading, serve
loaded, load = [], loading.load_model
def watched(*args, **kwargs):
    handle = load(*args, **kwargs)
    loaded.append(weakref.ref(handle))
    return handle
loading.load_model = watched
try:
    serve.main([sys.argv[1], "--no-such-vllm-flag"])
except SystemExit:  # vLLM's parser refused the flag
    pass
gc.collect()
print("imported" if "vllm.multimodal.media.audio" in sys.modules else "not-imported",
      "held" if loaded[0]() is not None else "freed")
"""


@requires("vllm")
def test_serve_frees_what_it_loaded_once_its_call_returns(tiny_path):
    done = subprocess.run([sys.executable, "-c", SERVE_REFUSED, str(tiny_path("llama"))], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.stdout.split()[-2:] == ["imported", "freed"], done.stdout[-2000:] + done.stderr[-4000:]


@requires("vllm")
def test_the_engine_dies_with_its_driver_on_sigkill(idle_driver):
    driver, engine = idle_driver
    try:
        assert engine
        driver.process.kill()
        driver.process.wait(10)
        killed = time.monotonic()
        _, alive = psutil.wait_procs(engine, timeout=ORPHANS_GONE_S)
        print(f"\n[life] driver SIGKILLed: its {len(engine)} engine processes gone in "
              f"{time.monotonic() - killed:.2f} s")
        assert not alive, f"engine processes outlived their driver by {ORPHANS_GONE_S} s: {alive}"
    finally:
        driver.process.kill()


@requires("vllm")
def test_ctrl_c_at_random_moments_never_corrupts_the_engine(tiny_path):
    interrupts = 40
    driver = _Driver("interrupts", tiny_path("llama"), interrupts)
    rng = random.Random(19)
    try:
        engine = driver.pids()
        for i in range(interrupts):
            assert driver.line() == ["go", str(i)]
            time.sleep(rng.uniform(0.0, 0.4))
            os.kill(driver.process.pid, signal.SIGINT)
            said = driver.line(timeout=120)
            assert said == ["ok", str(i)], f"after interrupt {i}, the driver said {said}{driver.errors()}"
        assert driver.line() == ["closed"]
        assert driver.process.wait(60) == 0
        _, alive = psutil.wait_procs(engine, timeout=5)
        assert not alive, f"processes left after shutdown(): {alive}"
    finally:
        driver.process.kill()


def test_ctrl_c_inside_a_send_is_held_back_until_the_send_is_out():
    """What keeps a message to the engine whole (compat.guard_sends), with a real SIGINT at a set moment."""
    from interp_engine.backends.vllm.procs import deferred_interrupt

    done = []
    with pytest.raises(KeyboardInterrupt):
        with deferred_interrupt():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler would have run by now
            done.append("the whole send")
    assert done == ["the whole send"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    seen = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        with deferred_interrupt():  # a caller's own handler is held back too, then called once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            assert seen == []
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)

    def off_main():  # Python runs handlers on the main thread only: off it there is nothing to hold back
        with deferred_interrupt():
            result.append(signal.getsignal(signal.SIGINT) is signal.default_int_handler)

    result: list = []
    worker = threading.Thread(target=off_main)
    worker.start()
    worker.join()
    assert result == [True]


def test_ctrl_c_while_a_result_is_read_is_an_interrupt_not_a_failed_call(tmp_path):
    """safetensors' native reader turns a KeyboardInterrupt raised in its Python callbacks into a ValueError,
    which a caller would take for a failed call (a CI run lost its driver so): wire.decode holds Ctrl-C back."""
    from safetensors.torch import save_file

    from interp_engine.backends.vllm import wire

    path = str(tmp_path / "result.safetensors")
    save_file({f"t{i}": torch.full((4,), float(i)) for i in range(400)}, path)
    armed, stop = [False], threading.Event()  # a plain store: the handler may run between any two bytecodes

    def ctrl_c(signum, frame):  # Ctrl-C as Python's own handler raises it, but only inside the read
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt

    def interrupt():
        while not stop.wait(0.003):
            os.kill(os.getpid(), signal.SIGINT)

    raised: list[type] = []
    previous = signal.signal(signal.SIGINT, ctrl_c)
    sender = threading.Thread(target=interrupt)
    sender.start()
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                armed[0] = True
                value = float(wire.decode(path)["t399"][0])
                armed[0] = False
                assert value == 399.0
            except KeyboardInterrupt:
                raised.append(KeyboardInterrupt)
            except Exception as e:  # noqa: BLE001 - the failure this test is about (the handler disarmed)
                raised.append(type(e))
    finally:
        stop.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
    assert raised, "no interrupt landed inside a read: this test checked nothing"
    assert set(raised) == {KeyboardInterrupt}, f"an interrupt became {set(raised) - {KeyboardInterrupt}}"
