"""The driver's result arena: one shared file per engine whose pages carry prefill results call after call.

A result written into a fresh file each call paid, on every call, for the kernel allocating its pages (in the
worker), mapping them (in the driver) and freeing them; the arena's pages are allocated once, mapped once in
each process, and reused. A call takes a slot sized from the last result of its kind (`ResultSizes`); rank 0
writes there if its result fits, else into the call's own file as before (`results.write_slot`).

Ownership is handed over, not copied out: the tensors a call returns are views of its slot, and the slot is
free again only once the last of them is gone (a finalizer on the one buffer they all view), so no later call
ever writes under a result its caller still holds. A caller holding many results only fills the arena: calls
then fall back to files. A slot whose call failed goes back once the workers hold nothing of the call (after
RELEASE); one whose engine faulted never does (a stopped worker might still write it). At shutdown the file is
unlinked: results still held stay valid (their mapping keeps the pages), /dev/shm keeps nothing; a driver killed
outright leaves it to the next engine's `wire.sweep_orphans`.

The arena grows to fit what it has held: a slot past the pages allocated so far allocates them (`posix_fallocate`)
before any worker writes there, and they stay until shutdown, so the memory it holds is the most its slots held at
once, at most its size (`INTERP_ENGINE_ARENA_BYTES`, 256 MiB). Allocated by the driver, never by a worker's first
touch: a /dev/shm too small for a slot refuses it (the call falls back to a file, which reports a full disk as an
error) instead of killing the worker with SIGBUS as it writes.
"""

import collections
import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from interp_engine.backends.vllm import wire
from interp_engine.errors import env_bytes

# The most memory it holds: a 64x128-token capture of resid_post at 8 layers of width 512 (128 MiB, its slot 160)
# fits; larger results go to files of their own, whose pages are allocated and freed call by call.
ARENA_ENV, ARENA_BYTES = "INTERP_ENGINE_ARENA_BYTES", 256 << 20
PAGE = 4096  # slots start on pages: a result's views are aligned, and two slots never share a page
SMALLEST = 64 << 10  # a slot for a kind of call not seen yet: most one-point calls fit
HEADROOM = 1.25  # over the last result of the kind: prompts' lengths vary, headers too


def arena_bytes() -> int:
    """The arena's size from the environment: one smaller than the smallest slot would never hold a result."""
    return env_bytes(ARENA_ENV, ARENA_BYTES, least=SMALLEST, why="the smallest result slot")


@dataclass(frozen=True)
class Slot:
    offset: int
    size: int


class ResultArena:
    """One engine's arena: its file (made at the first `take`), free slots, and slots handed to callers."""

    def __init__(self):
        self.size = arena_bytes()  # read at engine start: a bad value refused, with the fix
        self.path = ""
        self._map: mmap.mmap | None = None
        self._fd = -1  # open from the file's making to close: slots allocate its pages
        self._allocated = 0  # its first bytes, allocated (pages from here on are not, until a slot reaches them)
        self._free: list[tuple[int, int]] = [(0, self.size)]  # (offset, size), in offset order, coalesced
        self._lock = threading.Lock()
        # Slots whose results died: appended by finalizers (any thread, even inside take's own allocations),
        # taken back under the lock by the next take or give.
        self._returned: collections.deque[Slot] = collections.deque()
        self.closed = False

    def take(self, nbytes: int) -> Slot | None:
        """A free slot of at least `nbytes` (header room included), its length cleared; None if none is free."""
        size = -(-max(int(nbytes * HEADROOM), SMALLEST) // PAGE) * PAGE
        with self._lock:
            if self.closed or size > self.size or not self._open():
                return None
            self._reclaim()
            for i, (offset, free) in enumerate(self._free):
                if free >= size:
                    if not self._allocate(offset + size):
                        return None
                    self._free[i:i + 1] = [(offset + size, free - size)] if free > size else []
                    self._map[offset:offset + 8] = bytes(8)
                    return Slot(offset, size)
        return None

    def give(self, slot: Slot) -> None:
        """A slot back (its call ended without handing it over), once no worker will write it."""
        self._returned.append(slot)
        with self._lock:
            self._reclaim()

    def written(self, slot: Slot) -> int:
        """The bytes a worker wrote into the slot (0: none, the result went to a file or COLLECT; or shut down)."""
        mapped = self._map
        # The length before the safetensors bytes, written last (`results.write_slot`).
        n = 0 if mapped is None else int.from_bytes(mapped[slot.offset:slot.offset + 8], "little")
        return n if n <= slot.size - 8 else 0

    def hand_over(self, slot: Slot, nbytes: int) -> Tensor:
        """The slot's bytes as a uint8 tensor: every view of it holds the slot, which comes back when the last dies."""
        view = memoryview(self._map)[slot.offset + 8:slot.offset + 8 + nbytes]  # after `written`: not closed meanwhile
        weakref.finalize(view, self._returned.append, slot)
        return torch.frombuffer(view, dtype=torch.uint8)

    def table(self, slot: Slot) -> list:
        """The slot as a table names it (`wire.table`'s `slot`)."""
        return [self.path, slot.offset, slot.size]

    def close(self) -> None:
        """At shutdown: no more slots; the file goes (results held keep their pages through their mapping)."""
        with self._lock:
            self.closed = True
            path, self.path, self._map = self.path, "", None  # unmapped once nothing views it
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        if path:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _open(self) -> bool:
        if self._map is None:
            path = wire.result_path(f"arena-{uuid.uuid4().hex}")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            except OSError:
                return False
            try:
                os.ftruncate(fd, self.size)
                self._map = mmap.mmap(fd, self.size)
            except OSError:
                os.close(fd)
                os.unlink(path)
                return False
            self.path, self._fd = path, fd
        return True

    def _allocate(self, end: int) -> bool:
        """The file's pages up to `end` allocated (once: they stay until close); False if the OS refuses."""
        if end > self._allocated:
            try:
                os.posix_fallocate(self._fd, self._allocated, end - self._allocated)
            except OSError:  # /dev/shm full: this slot is refused, the call writes a file of its own
                return False
            self._allocated = end
        return True

    def _reclaim(self) -> None:
        while self._returned:
            slot = self._returned.popleft()
            spans = sorted([*self._free, (slot.offset, slot.size)])
            self._free = []
            for offset, size in spans:
                if self._free and self._free[-1][0] + self._free[-1][1] == offset:
                    self._free[-1] = (self._free[-1][0], self._free[-1][1] + size)
                else:
                    self._free.append((offset, size))
