"""SAEs cross into vLLM's workers once, not in every call's table, and leave them when a bound is reached.

A call's table travels in its first request's tag, and an SAE inside it is its weights in base64: a 16x SAE of a
4096-wide model is 1 GB, and even a small one cost every steered call its encoding, transfer and decoding (~130 ms
for a 16x SAE of a 256-wide model, measured with benchmarks/sae.py). So the driver (offline: the runtime; serving:
the server process) sends each SAE once (`ie_put_saes`, an RPC before the call's first request) and the table
names it by `key`, its content digest; every worker decodes it once and keeps it in `sae.KEPT`.

The driver's `Held` is the one record of what the workers hold: it decides every eviction and sends it with the
next put, so driver and workers never disagree (a worker never evicts on its own). Workers hold at most
`INTERP_ENGINE_SAE_BYTES` bytes of SAE tensors (default 4 GiB, read at each call that uses an SAE), least recently
used evicted first; an SAE that a call in flight names (from its put until its table leaves the workers) is never
evicted, so while calls in flight name more than the bound, the workers hold more until the next put after they end.
A call whose SAEs alone exceed the bound is refused before anything is sent.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable, Container

from interp_engine import sae as sae_module
from interp_engine.errors import SpecError, env_bytes, fix
from interp_engine.sae import KEPT, SAE
from interp_engine.tensor_data import TensorData

BOUND_ENV = "INTERP_ENGINE_SAE_BYTES"
DEFAULT_BOUND = 4 << 30
_puts = 0  # worker side: SAEs decoded since the engine started (`held`)


def key(sae: SAE) -> str:
    return sae.key


def size(sae: SAE) -> int:
    """Bytes of its tensors, as a worker holds them."""
    return sum(t.tensor.nbytes for t in (sae.W_enc, sae.b_enc, sae.W_dec, sae.b_dec, sae.threshold) if t is not None)


def bound() -> int:
    """The bytes of SAEs the workers may hold (`INTERP_ENGINE_SAE_BYTES`)."""
    return env_bytes(BOUND_ENV, DEFAULT_BOUND)


def referenced(spec, compiled: dict) -> tuple[dict, dict[str, SAE]]:
    """`compiled` (`spec.to_dict()`) with each op's SAE replaced by `{"ref": key}`, and those SAEs by key."""
    refs = {i: (key(op.sae), op.sae) for i, op in enumerate(spec.ops) if isinstance(getattr(op, "sae", None), SAE)}
    if not refs:
        return compiled, {}
    ops = [{**op, "sae": {"ref": refs[i][0]}} if i in refs else op for i, op in enumerate(compiled["ops"])]
    return {**compiled, "ops": ops}, dict(refs.values())


def fits(saes: dict[str, SAE], limit: int) -> None:
    """Refuse a call whose SAEs alone exceed what the workers may hold."""
    total = sum(size(s) for s in saes.values())
    if total > limit:
        raise SpecError(fix(f"this call's SAEs take {total} bytes; the workers hold at most {limit} ({BOUND_ENV}).",
                            f"set {BOUND_ENV} to at least {total} where the engine's driver runs (the server, or "
                            "this process), or load the SAE in a smaller dtype (load_sae(..., dtype=torch.float16))."))


def encoded(saes: dict[str, SAE]) -> dict[str, dict]:
    return {k: s.encoded(TensorData.to_dict) for k, s in saes.items()}


class Held:
    """Driver side: the SAEs an engine's workers hold (sizes, least recently used first) and the calls that name
    each. Calls not in the caller's `in_flight` have ended: they pin nothing."""

    def __init__(self):
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.users: dict[str, set[str]] = {}
        self.lock = threading.Lock()  # offline calls come from threads: one put at a time

    def plan(self, call: str, saes: dict[str, SAE], in_flight: Container[str]) -> tuple[dict[str, SAE], list[str]]:
        """Mark `saes` used by `call` (held from now on); return those to put and the keys to evict."""
        limit = bound()
        fits(saes, limit)
        for k in list(self.users):
            if not (users := {c for c in self.users[k] if c in in_flight}):
                del self.users[k]
            else:
                self.users[k] = users
        for k in saes:
            self.users.setdefault(k, set()).add(call)
            if k in self.sizes:
                self.sizes.move_to_end(k)
        new = {k: s for k, s in saes.items() if k not in self.sizes}
        self.sizes.update((k, size(s)) for k, s in new.items())
        total, evicted = sum(self.sizes.values()), []
        for k in [k for k in self.sizes if k not in self.users]:
            if total <= limit:
                break
            total -= self.sizes.pop(k)
            evicted.append(k)
        return new, evicted

    def forget(self, saes: dict[str, SAE]) -> None:
        """A put that failed: its SAEs are not held (a retry puts them again; `keep` skips any that arrived)."""
        for k in saes:
            self.sizes.pop(k, None)

    def put(self, call: str, spec, compiled: dict, in_flight: Container[str],
            send: Callable[[dict, list], object]) -> dict:
        """Offline: `compiled` by reference, its SAEs held by the workers for `call` first (`send(new, evict)`:
        the RPC)."""
        compiled, saes = referenced(spec, compiled)
        if not saes:
            return compiled
        with self.lock:
            new, evicted = self.plan(call, saes, in_flight)
            if new or evicted:
                try:
                    send(encoded(new), evicted)
                except BaseException:
                    self.forget(new)
                    raise
        return compiled


# ------------------------------------------------------------------------------------------- worker side

def keep(saes: dict[str, dict], evict: list[str] = ()) -> bool:
    """Forget the SAEs the driver evicts (and their accelerator copies), then decode each new one once (its digest
    is `key`: not hashed again)."""
    global _puts
    for k in evict:
        KEPT.pop(k, None)
        prefix = f"sae:{k}."
        for entry in [e for e in sae_module.ON_DEVICE if e[0].startswith(prefix)]:
            del sae_module.ON_DEVICE[entry]
    for k, d in saes.items():
        if k not in KEPT:
            KEPT[k] = SAE.decoded(d, what=f"SAE {k}", digest=f"sae:{k}")
            _puts += 1
    return True


def held() -> dict:
    """What this worker holds: the SAEs' keys, their bytes, and how many SAEs it was ever sent."""
    return {"saes": sorted(KEPT), "bytes": sum(size(s) for s in KEPT.values()), "puts": _puts}
