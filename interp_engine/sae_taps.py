"""The SAEs in vllm-static's `static_writes`: what each compiles into the graph, and the refusals where it cannot.

- A bare relu or jumprelu SAE, unnormalised, declares clamps at its point (`Taps.clamps`,
  backends/vllm/static_clamp.py): a clamped feature's activation needs only its own encoder column, so the tap
  holds slots of columns filled per step from the calls' own SAEs, and costs no more than that.
- `S.Splice(sae)`, and a bare topk or normalised SAE, declare the SAE's whole encode (`Taps.splices`,
  `DeclaredSAE`, backends/vllm/static_splice.py): a Splice needs every feature, and so does a Clamp of a topk SAE
  (whether a feature is in a row's top k) or of a normalised one (the row's own input scale). That graph serves
  the SAE's Splices and its Clamps, and costs its encode and decode at every row of every step.

Any point the engine can write, the SAE `d_in` values wide there. Under tensor parallelism a sharded point (q, k,
v, z: heads; mlp_act: neurons) is each rank's slice, so its SAE taps gather it in the graph first and keep the
rank's slice of the result (backends/vllm/static.py); the residual stream's points are whole on every rank. At
num_gpus > 1 other points (router_logits) are refused: untested there.
"""

import math
from typing import Any

from interp_engine.errors import SpecError, fix
from interp_engine.sae import SAE, TENSORS
from interp_engine.spec import Splice
from interp_engine.taps import CLAMP_SLOTS, DeclaredSAE
from interp_engine.tensor_data import SPEC_DTYPES
from interp_engine.validate import feature_shape

_DTYPE_NAMES = {v: k for k, v in SPEC_DTYPES.items()}
_WHOLE = ("batch", "pos", "d_model")  # replicated under tensor parallelism, and tested there
_SHARDED = {"n_heads", "n_kv_heads", "d_mlp"}  # split across ranks (backends/vllm/shards.py)


def declared_saes(static_writes: Any, dims, num_gpus: int = 1) -> tuple[Any, tuple, tuple[DeclaredSAE, ...]]:
    """`static_writes` without its SAEs, the points where they compile a clamp tap, and the SAEs whose whole
    encode is compiled in. Every problem is reported at once, before anything loads."""
    if not isinstance(static_writes, list | tuple) or not any(isinstance(w, SAE | Splice) for w in static_writes):
        return static_writes, (), ()
    problems = []
    for w in (w for w in static_writes if isinstance(w, SAE | Splice)):
        sae = w if isinstance(w, SAE) else w.sae
        problems += _refusals(sae, dims, num_gpus)
        if isinstance(w, Splice) and (w.error or w.positions != Splice(sae).positions):
            problems.append(f"a Splice of {sae.reads} with error= or positions=: a declaration is S.Splice(sae), "
                            "and those belong to each call's Splice")
    if problems:
        raise SpecError(fix("static_writes declares SAEs the compiled graph cannot hold: " + "; ".join(problems) + ".",
                            "declare SAEs (clamps) or S.Splice(sae) as above, or use backend=\"vllm\", which applies "
                            "any SAE per request."))
    whole = [w.sae if isinstance(w, Splice) else w for w in static_writes
             if isinstance(w, Splice) or (isinstance(w, SAE) and not w.acts_per_feature)]
    splices = tuple(DeclaredSAE(sae.key, sae.reads.resolve(dims.n_layers),
                                (("activation", sae.activation), ("k", sae.k), ("normalize", sae.normalize),
                                 ("apply_b_dec_to_input", sae.apply_b_dec_to_input)),
                                tuple((name, t.shape, _DTYPE_NAMES[t.tensor.dtype]) for name in TENSORS
                                      if (t := getattr(sae, name)) is not None))
                    for sae in whole)
    clamps = declared_points(static_writes, dims.n_layers)
    return [w for w in static_writes if not isinstance(w, SAE | Splice)], clamps, splices


def declared_points(static_writes: Any, n_layers: int) -> tuple:
    """The points of the SAEs in `static_writes`, bare or in a Splice."""
    if not isinstance(static_writes, list | tuple):
        return ()
    return tuple((w if isinstance(w, SAE) else w.sae).reads.resolve(n_layers)
                 for w in static_writes if isinstance(w, SAE | Splice))


def _refusals(sae: SAE, dims, num_gpus: int) -> list[str]:
    address = sae.reads.resolve(dims.n_layers)
    if sae.writes is not None:
        return [f"a transcoder of {sae.reads} (writes {sae.writes}): its features of one point would edit another"]
    if address.info.pos_axis != 1:
        return [f"an SAE of {address}: an SAE reads one vector per position"]
    width = math.prod(feature_shape(address, dims, 1))
    if width == 0:  # load_model says why first (`arch.lacks`); the sizer has no arch
        return [f"an SAE of {address}: this model has no {address.point}"]
    if sae.d_in != width:
        return [f"an SAE of {address} reads {sae.d_in} values per position, but {address} holds {width}"]
    if num_gpus > 1 and address.info.axes != _WHOLE and not set(address.info.axes) & _SHARDED:
        return [f"an SAE of {address} at num_gpus={num_gpus}: compiled SAE taps under tensor parallelism are served "
                "at the residual stream's points and the sharded ones (q, k, v, z, mlp_act) only, where tested "
                "(backend=\"vllm\" serves it, or num_gpus=1)"]
    return []


def tap_bytes(clamps: tuple, splices: tuple[DeclaredSAE, ...], dims, rows: int) -> int:
    """What the SAE taps allocate per rank for `rows` rows a step: each clamp tap's slots (encoder columns,
    biases, thresholds and decoder rows, float32) and per-row counts and targets; each SAE whose encode is
    compiled in, its weights, a row mask, and for a topk or normalised one its clamp slots; plus the largest
    dense encode one step makes, (rows, d_sae) in the SAE's dtype, alive while its tap runs."""
    total = 0
    for address in dict.fromkeys(clamps):
        width = math.prod(feature_shape(address, dims, 1))
        total += 4 * (2 * width * CLAMP_SLOTS + 2 * CLAMP_SLOTS + 2 * rows * CLAMP_SLOTS)
    dense = 0
    for sae in splices:
        shapes = {name: (shape, SPEC_DTYPES[dtype].itemsize) for name, shape, dtype in sae.tensors}
        (_, d_sae), size = shapes["W_enc"]
        total += sum(math.prod(shape) * itemsize for shape, itemsize in shapes.values()) + 2 * rows  # + masks
        settings = dict(sae.settings)
        if settings["activation"] == "topk" or settings["normalize"] != "none":  # its clamp slots
            total += 8 * CLAMP_SLOTS + 2 * rows * CLAMP_SLOTS * size + rows
        dense = max(dense, rows * d_sae * size)
    return total + dense
