"""Write-through: a prefill call's rows copied once, as they are recorded, into their final place in its arena slot.

Without it a recorded row block was kept (a copy: the model goes on using its tensors), then, after the call's
last step, copied again into the slot (`results.write_slot`): per 8x16 call of resid_post at 8 layers, 2 MB
copied twice and 32 blocks held between steps. Here, when the call is adopted, its slot is laid out from what
the driver knows (the prompts' lengths: `wire.table`): the shared (prompt, position) index first, then each key's
rows, prompt after prompt, each key's region placed at its first record (its width and dtype are known then).
Each record is copied straight into its rows; at hand-back only the index and the header are written, and last
the length that makes the slot readable (`arena.py`). The bytes are those `results.write_slot` writes, in the
layout `results.read` reads, so the driver is unchanged.

Where this plan does not hold, records go as before (`StepState.record`): a key that does not fit the slot, rows
outside the prompts. A call with any such record, or a key missing rows (none should: every position of a
prefill runs), is written to the call's file instead, its direct rows read from the slot (`records`), so nothing
is lost. Only rank 0 on the CPU plans one (`plan`): device rows leave the device with their step's others.
"""

import json

import numpy as np
import torch
from torch import Tensor

from interp_engine.backends.vllm import results, wire

ALIGN = 8  # every region starts aligned for a view of any dtype
ROOM_PER_KEY = 256  # header bytes reserved per key (an entry is ~100, its shared-index line ~40)


class WriteThrough:
    """One call's slot, laid out as its rows arrive."""

    def __init__(self, slot: tuple[str, int, int], lengths: tuple[int, ...], keys: int):
        arena, self.offset, self.size = slot
        self.whole = results.mapped(arena)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.starts = np.concatenate(([0], np.cumsum(self.lengths)))
        self.tokens = int(self.starts[-1])
        # The header's room: fixed now, as every region's place depends on it; padded with spaces when written.
        self.room = ROOM_PER_KEY * (keys + 4)
        self.data = self.offset + 16 + self.room  # after the slot's length and the header's
        self.used = 2 * self.tokens * 8  # the index (prompt, position: int64) first
        self.regions: dict[str, tuple[Tensor, int, np.ndarray]] = {}  # key -> (rows, data offset, covered)
        self._seen: tuple = (None, None, None)  # the last (prompts, positions) placed, and where they went

    def put(self, key: str, prompts: Tensor, positions: Tensor, value: Tensor) -> bool:
        """Copy a record's rows into the key's region; False (nothing written) where this call's plan does not
        hold for them, for the caller to keep them as before."""
        region = self.regions.get(key) or self._place(key, value)
        if region is None or value.shape[1:] != region[0].shape[1:] or value.dtype != region[0].dtype:
            return False
        where = self._where(prompts, positions)
        if where is None or len(value) != len(prompts):
            return False
        rows, _, covered = region
        if isinstance(where, slice):  # the usual record: a run of one prompt's rows, or more
            rows[where].copy_(value)
        else:
            rows.index_copy_(0, where, value)
        covered[where] = True
        return True

    def _where(self, prompts: Tensor, positions: Tensor) -> slice | Tensor | None:
        """Where rows at (prompts, positions) go: a slice, or an index; None if one is outside the prompts. A
        step's addresses share one pair of index tensors: worked out once for them all."""
        if self._seen[0] is prompts and self._seen[1] is positions:
            return self._seen[2]
        p, q = prompts.numpy(), positions.numpy()
        where = None
        if len(p) and p.min() >= 0 and p.max() < len(self.lengths) and q.min() >= 0 and (q < self.lengths[p]).all():
            index = self.starts[p] + q
            first = int(index[0])
            where = slice(first, first + len(index)) if index[-1] - first == len(index) - 1 and \
                (np.diff(index) == 1).all() else torch.from_numpy(index)
        self._seen = (prompts, positions, where)  # held, so neither id is reused while compared
        return where

    def finish(self) -> bool:
        """Write the index and the header, then the length that makes the slot readable; False (nothing made
        readable) if a key misses rows or the header outgrew its room."""
        if any(not covered.all() for _, _, covered in self.regions.values()):
            return False
        prompt, pos = self._index()
        if not self.regions:
            return False
        shared, first, header = {}, None, {}
        for key, (rows, start, _) in self.regions.items():
            if first is None:
                first = key
                header[f"{key}|prompt"] = _entry(prompt, 0)
                header[f"{key}|pos"] = _entry(pos, self.tokens * 8)
            else:
                shared[key] = first
            header[f"{key}|value"] = _entry(rows, start)
        if shared:
            header = {"__metadata__": {wire.ROWS: json.dumps(shared)}, **header}
        text = json.dumps(header, separators=(",", ":")).encode()
        if len(text) > self.room:
            return False
        whole, at = self.whole, self.offset + 8
        whole[at:at + 8] = np.frombuffer(self.room.to_bytes(8, "little"), dtype=np.uint8)
        whole[at + 8:at + 8 + self.room] = np.frombuffer(text.ljust(self.room), dtype=np.uint8)
        index = whole[self.data:self.data + 2 * self.tokens * 8].view(np.int64)
        index[:self.tokens], index[self.tokens:] = prompt, pos
        nbytes = 8 + self.room + self.used
        whole[self.offset:self.offset + 8] = np.frombuffer(nbytes.to_bytes(8, "little"), dtype=np.uint8)
        return True

    def records(self) -> dict[str, list[tuple[Tensor, Tensor, Tensor]]]:
        """The direct rows as records (`WorkerCall.records`' form), views of the slot, for a call written to its
        file after all: only the rows recorded, every key's index one shared pair where all were."""
        prompt, pos = (torch.from_numpy(a) for a in self._index())
        out = {}
        for key, (rows, _, covered) in self.regions.items():
            if covered.all():
                out[key] = [(prompt, pos, rows)]
            else:
                mask = torch.from_numpy(covered)
                out[key] = [(prompt[mask], pos[mask], rows[mask])]
        return out

    def _place(self, key: str, value: Tensor) -> tuple[Tensor, int, np.ndarray] | None:
        nbytes = self.tokens * value[0].numel() * value.element_size() if len(value) else 0
        start = -(-self.used // ALIGN) * ALIGN
        if not nbytes or self.data + start + nbytes > self.offset + self.size:
            return None
        raw = torch.from_numpy(self.whole[self.data + start:self.data + start + nbytes])
        rows = raw.view(value.dtype).view(self.tokens, *value.shape[1:])
        self.used = start + nbytes
        self.regions[key] = region = (rows, start, np.zeros(self.tokens, dtype=bool))
        return region

    def _index(self) -> tuple[np.ndarray, np.ndarray]:
        """Every row's (prompt, position), prompt after prompt."""
        prompt = np.repeat(np.arange(len(self.lengths), dtype=np.int64), self.lengths)
        return prompt, np.arange(self.tokens, dtype=np.int64) - self.starts[prompt]


def _entry(array, start: int) -> dict:
    dtype = results.NAMES[array.dtype] if isinstance(array, Tensor) else "I64"
    nbytes = array.numel() * array.element_size() if isinstance(array, Tensor) else array.nbytes
    return {"dtype": dtype, "shape": list(array.shape), "data_offsets": [start, start + nbytes]}


def plan(table: dict, slot: tuple | None, reads: int) -> "WriteThrough | None":
    """A call's write-through, where its table says its prompts' lengths and names a slot."""
    lengths = table.get("lengths")
    if slot is None or not isinstance(lengths, list) or not lengths or \
            not all(isinstance(n, int) and n > 0 for n in lengths):
        return None
    try:
        return WriteThrough(slot, tuple(lengths), reads)
    except (OSError, ValueError):  # the driver's arena is gone (a shutdown): the call's file takes its records
        return None
