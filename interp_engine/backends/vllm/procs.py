"""The engine's processes and environment, seen from the driver: liveness, reaping, scoped variables, and
Ctrl-C held back around what must not be cut in half."""

import _signal
import contextlib
import os
import signal
import threading


def running(processes: list) -> bool:
    """Every one of these processes is alive (neither gone nor a zombie)."""
    import psutil

    for process in processes:
        try:
            if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
    return True


def close_children(pids: set[int], timeout: float) -> None:
    """Join and close the multiprocessing handles of these processes (the engine core is our child). Each open
    handle holds two pipe descriptors, and vLLM's shutdown leaves them open: two leaked per load otherwise."""
    import multiprocessing

    for child in multiprocessing.active_children():
        if child.pid in pids:
            child.join(timeout)
            if child.exitcode is None:
                child.kill()
                child.join(5)
            with contextlib.suppress(ValueError):  # still running: psutil kills it next
                child.close()


@contextlib.contextmanager
def environ(values: dict[str, str]):
    """Set these variables for the block, then put back exactly what was there (unset ones unset)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def exited(processes: list, timeout: float) -> list:
    """Wait up to `timeout` s for these processes to exit; return those still running. A zombie has exited: a
    worker whose engine core is gone is reparented to init, which here reaped it only 1-2 s later."""
    import time

    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = []
        for process in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if process.status() != psutil.STATUS_ZOMBIE:
                    left.append(process)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.02)


def stopped(processes: list) -> list:
    """Those of these processes that are stopped (SIGSTOP, SIGTSTP): alive, but they will never answer."""
    import psutil

    out = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.status() == psutil.STATUS_STOPPED:
                out.append(process)
    return out


def demand_seconds(processes: list) -> float:
    """Seconds these processes ran or waited to run, so far (gone ones count 0). A process starved of a core (a
    niced engine on a loaded machine) waits on the run queue: it counts as busy, as a computing one does, and
    only a sleeping one counts as idle. From each thread's /proc schedstat (run time + run-queue wait); CPU time
    alone where the kernel keeps no schedstat."""
    import psutil

    total = 0.0
    for process in processes:
        try:
            total += sum(_ran_or_waited(process.pid, task) for task in os.listdir(f"/proc/{process.pid}/task"))
        except OSError:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                total += times.user + times.system
    return total


def _ran_or_waited(pid: int, task: str) -> float:
    try:
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            ran, waited = f.read().split()[:2]
    except FileNotFoundError:
        if os.path.isdir(f"/proc/{pid}/task/{task}"):
            raise  # a kernel without schedstat: the caller counts CPU time instead
        return 0.0  # a thread that ended since the listing
    return (int(ran) + int(waited)) / 1e9


@contextlib.contextmanager
def deferred_interrupt():
    """Hold back SIGINT for the block and deliver it right after. Python runs signal handlers on the main
    thread only, between bytecodes: swapping the handler is what keeps a KeyboardInterrupt out of the block (a
    blocked signal mask would not: the kernel hands the signal to another thread and the main thread's handler
    still runs mid-block). Elsewhere (another thread, SIG_IGN or SIG_DFL, an outer deferral) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # _signal's own functions: signal's wrappers convert every handler to and from an enum, and a small call
    # passes here once per message and step (~20 times at 8 prompts).
    handler = _signal.getsignal(signal.SIGINT)
    if not callable(handler) or getattr(handler, "deferring", False):
        yield
        return
    caught: list = []

    def record(signum, frame):
        caught.append(frame)

    record.deferring = True
    _signal.signal(signal.SIGINT, record)
    try:
        yield
    finally:
        _signal.signal(signal.SIGINT, handler)
        if caught:
            handler(signal.SIGINT, caught[-1])
