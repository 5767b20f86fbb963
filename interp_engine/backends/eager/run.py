"""One call's edits, reads and records on eager: a `Run` holds the call's ops per address, the addresses to
record, optional zero deltas (for gradients) and what was recorded; every hook (`sites.py`) goes through
`Run.touch`."""

import functools
from collections.abc import Mapping

from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.edits import Step, apply, failure
from interp_engine.errors import InterpEngineError


@functools.cache
def at(point: str, layer: int | None) -> Address:
    # Hooks are installed per call for every layer; an Address validates itself when built, so build each once.
    return Address(point, layer)


class Run:
    """Edits, reads and records of one call. Created inside the call and dropped with it."""

    def __init__(self, ops: Mapping[Address, tuple], reads: frozenset[Address],
                 deltas: Mapping[Address, Tensor] | None = None):
        self.ops = ops
        self.reads = reads
        self.deltas = deltas or {}
        self.records: dict[Address, list[Tensor]] = {}
        self.stash: dict[int, Tensor] = {}
        self.step: Step | None = None
        self.wanted = frozenset(ops) | reads | frozenset(self.deltas)
        # Layers with nothing to read, edit or differentiate get no hook at all.
        self.layers = frozenset(a.layer for a in self.wanted if a.layer is not None)

    def wants(self, address: Address) -> bool:
        return address in self.wanted

    def touch(self, address: Address, x: Tensor, present=None) -> Tensor:
        """Apply this address's edits in spec order, add its delta, record it. Returns x itself if untouched."""
        for op in self.ops.get(address, ()):
            try:
                x = apply(op, x, address.info, self.step)
            except InterpEngineError:
                raise
            except Exception as e:  # a raw error from inside the forward would name torch, not the op
                raise failure(op, e) from e
        if address in self.deltas:
            x = x + self.deltas[address]
        if address in self.reads:
            seen = present(x) if present is not None else x
            self.records.setdefault(address, []).append(seen.detach())
        return x
