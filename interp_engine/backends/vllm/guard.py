"""The orphan guard: a tiny process that kills a vLLM engine's processes when the driver that owns them dies.

Started by the driver once its engine is up (`python -I <this file>`: nothing of interp_engine, torch or vLLM
is imported), it reads the engine's processes from its stdin, one `<pid> <create time>` line each, and waits.
`released` (the driver shut the engine down itself) ends it quietly. End of input without it means the driver
is gone (SIGKILL, a crash, the OOM killer): the kernel closed the pipe, and nothing else would ever stop the
engine core and its workers, which hold the accelerator's memory. It then kills them and their children.

Why a process and not a parent-death signal: the engine core is a multiprocessing spawn child of the driver
and the workers are its children; PR_SET_PDEATHSIG must be set by each of them on itself (vLLM's code, not
ours), and it fires on the death of the thread that forked, not of the process. A pipe's end of input is exact.
"""

import signal
import sys

RELEASED = "released"


def _verified(pid: int, created: float):
    """The process, if it is still the one the driver named (a reused pid has another create time)."""
    import psutil

    try:
        process = psutil.Process(pid)
        return process if abs(process.create_time() - created) < 0.01 else None
    except psutil.Error:
        return None


def kill_all(named: list[tuple[int, float]]) -> None:
    import psutil

    targets = {}
    for pid, created in named:
        process = _verified(pid, created)
        if process is None:
            continue
        targets[process.pid] = process
        try:
            for child in process.children(recursive=True):
                targets.setdefault(child.pid, child)
        except psutil.Error:
            pass
    for process in targets.values():
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(targets.values()), timeout=10)


def main() -> int:
    # The terminal's Ctrl-C and hang-up reach the whole process group: the guard must outlive the driver's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    named: list[tuple[int, float]] = []
    for line in sys.stdin:
        line = line.strip()
        if line == RELEASED:
            return 0
        pid, created = line.split()
        named.append((int(pid), float(created)))
    kill_all(named)
    return 0


if __name__ == "__main__":
    sys.exit(main())
