"""The engine's processes and environment, seen from the driver: liveness, reaping, scoped variables."""

import contextlib
import os


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
