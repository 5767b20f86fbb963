"""One vLLM engine's life, seen from the driver: its processes, one watchdog, the orphan guard, its end.

The watchdog is one thread per engine, started at load and stopped at shutdown. It waits on the processes'
pidfds (readable the moment a process exits) and, every TICK_S, checks what has no event: a process stopped
(SIGSTOP) for STOPPED_S while a call waits, and the protocol itself: while a call waits, a probe goes to the
engine core every PROBE_EVERY_S, and one left unanswered for PROTOCOL_S while the engine's processes sat idle
(a dead input thread: the processes live on, nothing is read) is a dead engine. Any of these, or a shutdown,
marks the engine faulted and fails whatever the driver waits on in vLLM's client, so no call waits forever.
Every send to the engine checks the mark first (`compat.guard_sends`): a call that arrives later fails at once.
"""

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from interp_engine.backends.vllm import compat, guard, sae_refs, shm, wire
from interp_engine.backends.vllm.arena import ResultArena
from interp_engine.backends.vllm.engine import remove_sockets
from interp_engine.backends.vllm.procs import demand_seconds, running, stopped
from interp_engine.errors import BackendError, fix

# Deadlines (seconds). A process that exits is seen at once (its pidfd); the rest within one TICK_S of these.
TICK_S = 0.5
STOPPED_S = 5.0  # a stopped engine process, while a call waits
PROBE_EVERY_S = 2.0  # while a call waits, how often the engine core is asked a trivial question
PROTOCOL_S = 10.0  # unanswered this long, with the engine idle (see IDLE_S), the protocol is dead
IDLE_S = 5.0  # seconds the engine's processes may run or wait to run over PROTOCOL_S and still count as idle: a
#               step computing, or starved of a core on a loaded machine (run-queue wait), keeps a thread runnable
#               the whole window (>= PROTOCOL_S: waited out, however long); a dead input loop leaves them asleep
#               but for short polls, whose waits a loaded machine stretches (a clean-clone CI run under load saw
#               more than 1 s of them in one window)

DIED, STOPPED, PROTOCOL, SHUT = "died", "stopped", "protocol", "shut down"
_NONE = object()  # no probe possible (an in-process engine core)


class EngineLife:
    """An engine (vLLM's `LLM`), its processes, its watchdog and guard, and why it can serve no more calls
    (`fault`, None while it can)."""

    def __init__(self, llm, procs: list, name: str, sockets: str | None = None):
        self.llm, self.procs, self.name, self.sockets = llm, list(procs), name, sockets
        self.segments = shm.unlink_joined(self.procs)  # every rank has joined: its tensor-parallel names go now
        wire.sweep_orphans()  # what killed drivers and engines left in /dev/shm
        shm.sweep_orphans()
        self.fault: str | None = None
        self.saes = sae_refs.Held()  # SAEs its workers hold
        self.arena = ResultArena()  # prefill results' pages, reused call after call; its file made at first use
        self.send_lock = threading.RLock()  # one message at a time to the engine core, probes included
        self._state = threading.Lock()
        self._waiting = 0  # calls now blocked on the engine
        self._wake_r, self._wake_w = os.pipe()
        compat.guard_sends(llm, self.send_lock, self.check)
        self._guard = _start_guard(self.procs)
        self._thread = threading.Thread(target=self._watch, name="interp_engine-watchdog", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ callers
    def check(self) -> None:
        """Raise this engine's BackendError if it can serve no more calls."""
        if self.fault is not None:
            raise self.error()

    @contextlib.contextmanager
    def waiting(self):
        """Around a blocking engine call: counted (the stopped and protocol checks run only while one waits),
        and any failure of a faulted engine becomes its BackendError."""
        self.check()
        with self._state:
            self._waiting += 1
        try:
            yield
        except Exception:
            if self.fault is None and not running(self.procs):
                self.fail(DIED)
            if self.fault is not None:
                raise self.error() from None
            raise
        finally:
            with self._state:
                self._waiting -= 1

    def fail(self, fault: str) -> None:
        """Mark the engine faulted (the first reason stays) and wake everything that waits on it."""
        with self._state:
            if self.fault is None:
                self.fault = fault
        with contextlib.suppress(Exception):  # a half-closed client: nothing left to wake
            compat.fail_waiters(self.llm)

    def end(self) -> None:
        """At shutdown, before vLLM's: calls in flight fail with a clear error; the watchdog stops."""
        self.fail(SHUT)
        os.write(self._wake_w, b"x")
        self._thread.join(5)

    def release(self) -> None:
        """After the engine's processes are reaped: the guard has nothing left to do, and no process is left to
        use the engine's socket folder (`engine.SOCKETS`) or its message queues (`shm.Segments`)."""
        guard_process, self._guard = self._guard, None
        if guard_process is not None:
            with contextlib.suppress(OSError):
                guard_process.stdin.write(guard.RELEASED + "\n")
                guard_process.stdin.close()
            try:
                guard_process.wait(5)
            except subprocess.TimeoutExpired:
                guard_process.kill()
                guard_process.wait(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        remove_sockets(self.sockets)
        self.segments.release()
        self.arena.close()  # no process of the engine is left to write it

    def error(self) -> BackendError:
        if self.fault == SHUT:
            return shut_down_error(self.name)
        why = {DIED: "its engine core or a worker process exited: killed, out of memory, or crashed",
               STOPPED: f"an engine process has been stopped (SIGSTOP) for over {STOPPED_S:.0f} s",
               PROTOCOL: f"its engine core stopped answering for {PROTOCOL_S:.0f} s while idle (its input loop "
                         "died; the processes live on)"}[self.fault]
        return BackendError(fix(
            f"the vLLM engine serving {self.name!r} has died ({why}), so this call cannot finish and no later "
            "call can run on it.",
            f"await model.shutdown() (it reaps what is left), then load_model({self.name!r}, ...) again."))

    # ------------------------------------------------------------------------------------------ watchdog
    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        pidfds = []
        for process in self.procs:
            with contextlib.suppress(OSError):  # already gone: `running` sees it on the first tick
                pidfds.append(os.pidfd_open(process.pid))
                poller.register(pidfds[-1], select.POLLIN)
        stopped_since: float | None = None
        probe, probe_sent, probe_cpu, last_probe = None, 0.0, 0.0, 0.0
        try:
            while self.fault is None:
                events = poller.poll(TICK_S * 1000)
                if self.fault is not None:
                    return
                if any(fd != self._wake_r for fd, _ in events) or not running(self.procs):
                    return self.fail(DIED)
                now, busy = time.monotonic(), self._waiting > 0
                if not stopped(self.procs):
                    stopped_since = None
                elif stopped_since is None:
                    stopped_since = now
                if busy and stopped_since is not None and now - stopped_since >= STOPPED_S:
                    return self.fail(STOPPED)
                if probe is not None and (probe is _NONE or probe.done()):
                    probe, last_probe = None, now
                if probe is None and busy and stopped_since is None and now - last_probe >= PROBE_EVERY_S:
                    with contextlib.suppress(Exception):  # a closed client: the next tick sees why
                        probe = compat.probe(self.llm) or _NONE
                        probe_sent, probe_cpu = now, demand_seconds(self.procs)
                elif probe is not None and now - probe_sent >= PROTOCOL_S:
                    cpu = demand_seconds(self.procs)
                    if busy and cpu - probe_cpu < IDLE_S:
                        return self.fail(PROTOCOL)
                    probe_sent, probe_cpu = now, cpu  # computing (a long step), or no call waits: wait on
        finally:
            for fd in pidfds:
                os.close(fd)


def shut_down_error(name: str) -> BackendError:
    return BackendError(fix(
        f"{name!r} was shut down (model.shutdown()) while this call was running on it, so the call was "
        "stopped; it did not start the engine again.",
        "run the call again: a call made after shutdown() loads the model afresh."))


def _start_guard(procs: list) -> subprocess.Popen | None:
    """The orphan guard (guard.py), told the engine's processes; None where it cannot start."""
    import psutil

    try:
        process = subprocess.Popen([sys.executable, "-I", str(Path(guard.__file__))], stdin=subprocess.PIPE,
                                   text=True, close_fds=True)
    except OSError:
        return None
    try:
        for p in procs:
            process.stdin.write(f"{p.pid} {p.create_time()!r}\n")
        process.stdin.flush()
    except (OSError, psutil.Error):  # an engine process already gone: the watchdog reports it
        pass
    return process
