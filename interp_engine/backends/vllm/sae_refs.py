"""SAEs cross into vLLM's workers once per engine, not in every call's table.

A call's table travels in its first request's tag, and an SAE inside it is its weights in base64: a 16x SAE of a
4096-wide model is 1 GB, and even a small one cost every steered call its encoding, transfer and decoding (~130 ms
for a 16x SAE of a 256-wide model, measured with benchmarks/sae.py). So the driver sends each SAE once per engine
(`ie_put_saes`, a synchronous RPC before the call's first request) and the table names it by `key`, its content
digest; every worker decodes it once and keeps it in `sae.KEPT` for the engine's life (its processes end with it).
"""

from collections.abc import Callable

from interp_engine.sae import KEPT, SAE


def key(sae: SAE) -> str:
    return sae.key


def by_reference(spec, compiled: dict, sent: set[str], put: Callable[[dict], object]) -> dict:
    """`compiled` (`spec.to_dict()`) with each op's SAE replaced by `{"ref": key}`; SAEs not yet in `sent` (the
    engine's) are first `put` to every worker and added to it."""
    refs = {i: (key(op.sae), op.sae) for i, op in enumerate(spec.ops) if isinstance(getattr(op, "sae", None), SAE)}
    if not refs:
        return compiled
    new = {k: compiled["ops"][i]["sae"] for i, (k, _) in refs.items() if k not in sent}
    if new:
        put(new)
        sent.update(new)
    ops = [{**op, "sae": {"ref": refs[i][0]}} if i in refs else op for i, op in enumerate(compiled["ops"])]
    return {**compiled, "ops": ops}


def keep(saes: dict[str, dict]) -> bool:
    """Worker side: decode each SAE the driver sent once (its digest is `key`: not hashed again)."""
    for k, d in saes.items():
        if k not in KEPT:
            KEPT[k] = SAE.decoded(d, what=f"SAE {k}", digest=f"sae:{k}")
    return True
