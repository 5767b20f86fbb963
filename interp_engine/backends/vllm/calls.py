"""A call as a worker holds it: its table (ops by point, reads, lens) and what was recorded for it.

A steering call (`wire.table(..., failures=True)`, the server's jobs that capture nothing) is never collected: a
failure, as it happens, is written by rank 0 into the call's file on the driver's host (made by the driver, never
by a worker: `wire.make_failure_file`), before the step's outputs leave the worker, so the driver answers the
moment its last request ends; the workers drop the table themselves
once the scheduler says the last request carrying it has finished (`InterpExtension._ie_finished`).
"""

import os
from dataclasses import dataclass, field

from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, wire
from interp_engine.spec import Spec


@dataclass
class WorkerCall:
    """One driver call's table, and what was recorded for it (per address: (prompt, position, value) rows)."""

    ops: dict[Address, tuple]
    reads: frozenset[Address]
    width: int = 0  # longest prompt: attention-pattern rows are padded to it
    lens: frozenset[Address] = frozenset()  # points read through the final norm and unembedding, here
    prompts: int = 0  # a prefill call's prompts, handed back once each one's last position has run; 0: collected
    path: str = ""  # where rank 0 writes a handed-back call's records (the driver's host only)
    slot: tuple | None = None  # (arena, offset, size): where they go instead if they fit (`arena.py`)
    failures: bool = False  # a steering call: its failure goes to `path` as it happens (see the module's text)
    ended: set[int] = field(default_factory=set)  # prompts whose last position has run
    records: dict[Address | str, list[tuple[Tensor, Tensor, Tensor]]] = field(default_factory=dict)
    keys: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)  # (prompt, layer)
    # Why this call failed in this worker, if it did: from then on its ops are skipped (its rows go through
    # unedited) and nothing more is recorded, while every other call in the same steps goes on. `COLLECT`
    # answers with the failure instead of records.
    error: str = ""
    error_in_spec: bool = False  # an op failed (SpecError on the driver), rather than a read (BackendError)

    @classmethod
    def from_table(cls, table: dict) -> "WorkerCall":
        """The driver validated the spec and hashed its tensors; the worker checks the table's structure (op
        names, fields, dtypes, sizes) but not the tensors' values again. A table without the driver's
        fingerprint goes through the full gate."""
        fingerprint = table.get("fingerprint")
        spec = Spec.from_validated_dict(table["spec"], fingerprint=fingerprint) if isinstance(fingerprint, str) \
            else Spec.from_dict(table["spec"])
        ops: dict[Address, list] = {}
        for op in spec.ops:
            ops.setdefault(op.point, []).append(op)
        return cls({a: tuple(o) for a, o in ops.items()}, frozenset(Address.parse(r) for r in table["reads"]),
                   int(table.get("width", 0)), frozenset(Address.parse(r) for r in table.get("lens", ())),
                   int(table.get("prompts", 0)), local_path(table), failures=table.get("failures") is True,
                   slot=_slot(table) if local_path(table) else None)

    def wants(self, address: Address) -> bool:
        return address in self.ops or address in self.reads or address in self.lens

    def fail(self, message: str, *, in_spec: bool) -> None:
        """Contain a failure to this call. A failed call stays in every step's row map and its hooks keep firing:
        under tensor parallelism every rank must run the same gathers whether or not this rank failed."""
        if not self.error:
            self.error, self.error_in_spec = message, in_spec
            if self.failures and self.path and compat.tp_rank() == 0:  # into its driver's file, if still there
                wire.encode_failure(message, in_spec=in_spec, path=self.path, create=False)
        self.records.clear()
        self.keys.clear()


def local_path(table: dict) -> str:
    """The table's file, if this worker shares the driver's host (a worker elsewhere cannot hand a file over:
    its results wait for COLLECT)."""
    return str(table.get("path", "")) if wire.same_host(table.get("host", "")) else ""


def _slot(table: dict) -> tuple | None:
    """A table's arena slot, if it names one the way the driver does (`arena.py`): only such a file is mapped."""
    slot = table.get("slot")
    if isinstance(slot, list) and len(slot) == 3 and isinstance(slot[0], str) and \
            os.path.basename(slot[0]).startswith(f"{wire.TAG}-") and "-arena-" in slot[0] and \
            all(isinstance(n, int) and n >= 0 for n in slot[1:]):
        return slot[0], slot[1], slot[2]
    return None


def refuse(table: dict, message: str) -> None:
    """A refused steering table's failure, where its driver looks (rank 0: every rank refuses alike)."""
    if isinstance(table, dict) and table.get("failures") is True and (path := local_path(table)) and \
            compat.tp_rank() == 0:
        wire.encode_failure(message, in_spec=False, path=path, create=False)
