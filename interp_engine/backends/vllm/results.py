"""How a call's rows travel from a worker to the driver, below the protocol's names (`wire.py`).

Worker: each step's rows of every call (device copies) leave the device together, in one copy into pinned
host memory (`to_host`); on the CPU they are host tensors already and are kept as they are. At the call's end
its chunks are written as one file (`write`) in safetensors' layout, chunk after chunk, never joined first.
Driver: while the workers compute, it allocates the file's memory ahead (`reserve`, sized from the last result
of the same kind), so the worker's write fills pages already there; then the file is mapped, and every tensor
is a view of that one mapping: no copy, whatever the number of addresses (the tensors stay valid after the file
is deleted; they hold its pages while they live).
"""

import functools
import json
import os
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

# safetensors' dtype names; a result's dtypes are the model's, int64 for its indices
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
NUMPY = {torch.float64: np.float64, torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64,
         torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_}
WIDTHS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}  # bytes -> a dtype numpy has


# ------------------------------------------------------------------------------------------- worker

def to_host(values: Sequence[Tensor]) -> list[Tensor]:
    """`values` on the host: device tensors through one gather on the device and one non-blocking copy into
    pinned memory, synchronised once; host tensors as they are."""
    moved = [i for i, v in enumerate(values) if v.device.type != "cpu"]
    out = list(values)
    if not moved:
        return out
    # Largest elements first: every tensor then starts at a multiple of its element size in the joined bytes.
    moved.sort(key=lambda i: -values[i].element_size())
    joined = torch.cat([values[i].detach().contiguous().reshape(-1).view(torch.uint8) for i in moved])
    host = torch.empty(joined.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(joined, non_blocking=True)
    torch.cuda.current_stream(joined.device).synchronize()
    start = 0
    for i in moved:
        value = values[i]
        size = value.numel() * value.element_size()
        out[i] = host[start:start + size].view(value.dtype).view(value.shape)
        start += size
    return out


def write(target, tensors: Mapping[str, Sequence[Tensor]], metadata: Mapping[str, str] | None = None, *,
          create: bool = True) -> None:
    """A safetensors file at `target` (a path, or a binary file object), each tensor given as chunks along its
    first axis (host tensors, each with the others' trailing shape and dtype) and written as they are.
    `create=False`: only into a file that is there (its driver made it); none there, nothing is written."""
    text, entries, _ = _layout(tensors, metadata)
    buffers = [_array(c).reshape(-1).view(np.uint8) for chunks in entries for c in chunks]
    if isinstance(target, str):
        try:
            fd = os.open(target, os.O_WRONLY | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            if create:
                raise
            return
        # Not truncated first: that would free the memory the driver may have reserved for it (`reserve`).
        with os.fdopen(fd, "wb") as f:
            _write(f, text, buffers)
            f.truncate()
    else:
        _write(target, text, buffers)


def write_slot(arena: str, offset: int, size: int, tensors: Mapping[str, Sequence[Tensor]],
               metadata: Mapping[str, str] | None = None) -> bool:
    """The same safetensors bytes into a slot of the driver's result arena (`arena.py`: a shared file this
    process maps once, its pages reused call after call), after 8 bytes of their length; False, nothing written,
    if they do not fit. That length goes last: a slot reads as written only once whole, and the driver learns
    the extent without reading the header."""
    text, entries, total = _layout(tensors, metadata)
    try:
        whole = _mapped(arena)
    except (OSError, ValueError):  # the driver's arena is gone (a shutdown): the call's file still takes them
        return False
    if 16 + total > size or offset + size > len(whole):
        return False
    at = offset + 8
    whole[at:at + 8] = np.frombuffer(len(text).to_bytes(8, "little"), dtype=np.uint8)
    whole[at + 8:at + 8 + len(text)] = np.frombuffer(text, dtype=np.uint8)
    at += 8 + len(text)
    # numpy's copies: a torch copy of this size is a parallel op, which on a busy machine waits for a thread that
    # is not scheduled (8 addresses x 128 rows took 10-18 ms here on 2 loaded cores, numpy's ~0.2 ms). One
    # concatenate per run of chunks of one element type (a result's indices, then its values), not one per chunk.
    for run in _runs(entries):
        nbytes = sum(a.nbytes for a in run)
        np.concatenate(run, out=whole[at:at + nbytes].view(run[0].dtype))
        at += nbytes
    whole[offset:offset + 8] = np.frombuffer((8 + total).to_bytes(8, "little"), dtype=np.uint8)
    return True


def _runs(entries: Sequence[Sequence[Tensor]]) -> list[list[np.ndarray]]:
    """The chunks in file order, flat numpy arrays (views where contiguous), in runs of one element type."""
    runs: list[list[np.ndarray]] = []
    for chunk in (c for chunks in entries for c in chunks):
        flat = _array(chunk).reshape(-1)
        if runs and runs[-1][0].dtype == flat.dtype:
            runs[-1].append(flat)
        else:
            runs.append([flat])
    return runs


@functools.cache
def _mapped(arena: str) -> np.ndarray:
    """An arena, mapped shared for this process's life (one per engine: a worker never outlives its engine)."""
    import mmap

    fd = os.open(arena, os.O_RDWR)
    try:
        return np.frombuffer(mmap.mmap(fd, os.fstat(fd).st_size), dtype=np.uint8)
    finally:
        os.close(fd)


def _layout(tensors: Mapping[str, Sequence[Tensor]], metadata: Mapping[str, str] | None):
    """(header bytes, each tensor's non-empty chunks in file order, bytes after the length)."""
    # Largest elements first (as safetensors does): every tensor starts aligned for a view of its dtype.
    names = sorted(tensors, key=lambda n: -tensors[n][0].element_size())
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    start = 0
    for name in names:
        chunks = tensors[name]
        first = chunks[0]
        size = sum(c.numel() for c in chunks) * first.element_size()
        header[name] = {"dtype": NAMES[first.dtype], "shape": [sum(len(c) for c in chunks), *first.shape[1:]],
                        "data_offsets": [start, start + size]}
        start += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return text, [[c for c in tensors[n] if c.numel()] for n in names], len(text) + start


def _array(chunk: Tensor) -> np.ndarray:
    """A host chunk as a numpy array without a copy (torch's views cost a few microseconds each, and a call's
    result has a chunk per key and step); a dtype numpy lacks as the integers of its width."""
    chunk = chunk.detach()
    return chunk.numpy() if chunk.dtype in NUMPY else chunk.view(WIDTHS[chunk.element_size()]).numpy()


def _write(f, text: bytes, buffers: Iterable) -> None:
    f.write(len(text).to_bytes(8, "little"))
    f.write(text)
    for buffer in buffers:
        f.write(buffer)


# ------------------------------------------------------------------------------------------- driver

def reserve(path: str, nbytes: int) -> None:
    """Allocate a result file's memory before its worker writes it (the driver does, while the workers compute),
    its size left as it is (FALLOC_FL_KEEP_SIZE): the file stays empty until written, and the worker then writes
    into pages already there instead of allocating each one. Best effort: where the OS cannot, nothing happens."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        if (fallocate := _fallocate()) is not None:
            fallocate(fd, 1, 0, max(nbytes, 0))  # 1: FALLOC_FL_KEEP_SIZE; a refusal (ENOSPC...) leaves it to the worker
    finally:
        os.close(fd)


@functools.cache
def _fallocate():
    import ctypes

    try:
        call = ctypes.CDLL(None, use_errno=True).fallocate
    except (AttributeError, OSError):  # not Linux's libc
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    return call


def written(path: str) -> bool:
    """Whether a worker has written the result file at `path` (a reserved one is empty until then)."""
    try:
        return os.path.getsize(path) > 0
    except OSError:
        return False


def read(source: str | bytes | Tensor) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(tensors, metadata) of a safetensors file (a path), its bytes or a uint8 tensor holding them (an arena
    slot), every tensor a view of one buffer: the file mapped privately (copy on write: the file never
    changes), the bytes, or the tensor."""
    if isinstance(source, Tensor):
        buffer = source
    elif isinstance(source, str):
        buffer = torch.from_file(source, shared=False, size=os.path.getsize(source), dtype=torch.uint8)
    else:
        buffer = torch.frombuffer(bytearray(source), dtype=torch.uint8) if source else torch.empty(0, dtype=torch.uint8)
    if len(buffer) < 8:
        raise ValueError("not a safetensors buffer: shorter than its header's length")
    n = int.from_bytes(buffer[:8].numpy().tobytes(), "little")
    header = json.loads(buffer[8:8 + n].numpy().tobytes())
    metadata = header.pop("__metadata__", None) or {}
    base, out = 8 + n, {}
    entries = sorted(header.items(), key=lambda e: e[1]["data_offsets"][0])
    i = 0
    while i < len(entries):
        # A run: tensors back to back of one dtype and trailing shape (a call's addresses), viewed at once and
        # split, not three torch ops per tensor.
        name, first = entries[i]
        j, end = i + 1, first["data_offsets"][1]
        while first["shape"] and j < len(entries) and entries[j][1]["dtype"] == first["dtype"] and \
                entries[j][1]["shape"][1:] == first["shape"][1:] and entries[j][1]["data_offsets"][0] == end:
            end = entries[j][1]["data_offsets"][1]
            j += 1
        run, i = entries[i:j], j
        dtype = DTYPES[first["dtype"]]
        start = base + first["data_offsets"][0]
        raw = buffer[start:base + end]
        if start % dtype.itemsize:  # not aligned for a view (not a layout `write` makes): copied
            raw = raw.clone()
        if len(run) == 1:
            out[name] = raw.view(dtype).view(first["shape"])
            continue
        lengths = [entry["shape"][0] for _, entry in run]
        out.update(zip((n for n, _ in run), raw.view(dtype).view(sum(lengths), *first["shape"][1:]).split(lengths)))
    return out, metadata
