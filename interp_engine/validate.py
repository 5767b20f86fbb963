"""Everything checked before any forward pass, every problem reported at once."""

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from interp_engine.addresses import POINTS, Address
from interp_engine.arch import Dims, families_with
from interp_engine.arch.layers import lacking
from interp_engine.errors import BackendError, InterpEngineError, PointError, SpecError, fix
from interp_engine.sae import SAE, Features
from interp_engine.spec import SPEC_DTYPES, Ablate, Add, Clamp, Custom, Patch, Positions, Scale, Set, Spec, Splice, shown
from interp_engine.taps import CLAMP_SLOTS


@dataclass(frozen=True, slots=True)
class Plan:
    """A validated request: ops grouped per resolved address (spec order kept), and addresses to read."""

    ops: dict[Address, tuple]
    reads: tuple[Address, ...]

    def spec(self) -> Spec:
        """The ops as one spec, each at its resolved address: what a vLLM call's table carries."""
        return Spec(tuple(replace(op, point=a) for a, group in self.ops.items() for op in group))


def feature_shape(address: Address, dims: Dims, width: int) -> tuple[int, ...]:
    """One position's shape at `address` (for attention patterns: one query row, `width` keys), in the sizes of
    its layer (`Dims.at`: Gemma 4's global layers have their own head width)."""
    dims = dims.at(address.layer)
    return tuple(width if a == "k_pos" else getattr(dims, a) for a in address.info.axes
                 if a not in ("batch", "pos", "q_pos"))


# Per eager-only point: what the vLLM backends never form, and what to read there instead.
_EAGER_ONLY = {
    **{p: (f"a Gated DeltaNet's {what} outside its one custom op (the convolution, the gating and the delta rule "
           "run inside it, on its cached state)", "lin_out and lin_z (what its gated norm receives) or attn_out")
       for p, what in (("lin_q", "queries"), ("lin_k", "keys"), ("lin_v", "values"))},
}
# Per read-only point: why it cannot be written, and the fix ({L}: the layer).
_EXPERTS = "write router_logits.{L} to change which experts are chosen, or mlp_out.{L} to change what they add."
_READ_ONLY = {
    "expert_weights": ("the routing weights follow from the router's logits (softmax, top-k, renormalised)", _EXPERTS),
    "expert_out": ("each chosen expert's output follows from mlp_out's input and the router's choice", _EXPERTS),
    "attn_result": ("each head's output follows from z and W_O", "write z.{L} (one head: heads=) or attn_out.{L}."),
    "mlp_pre": ("the pre-activation is read at the input projection's output",
                "write mlp_act.{L} (the down projection's input) or mlp_out.{L}."),
    "mlp_pre_linear": ("the up projection's output is read at that projection",
                       "write mlp_act.{L} (the down projection's input) or mlp_out.{L}."),
}


def _resolve(address: Address, model, problems: list) -> Address | None:
    try:
        resolved = address.resolve(model.n_layers, model_name=model.name)
    except InterpEngineError as e:
        problems.append(e)
        return None
    lacks = model.arch.lacks(resolved.point) or lacking(resolved.point, resolved.layer, model.dims.layer_kinds)
    if lacks is not None:
        problems.append(PointError(f"{resolved} does not exist in {model.name!r}: {lacks}"))
        return None
    # Only eager narrows patterns away (HF attention other than "eager" never forms the weights).
    if resolved.info.needs_eager_attention and not model.capabilities.patterns:
        problems.append(BackendError(fix(
            f"{resolved} needs attention weights, which {model.attn_implementation!r} attention never forms.",
            f'load with load_model({model.name!r}, backend="eager", attn_implementation="eager").')))
        return None
    if resolved.info.eager_only_read and not model.capabilities.eager_only_reads:
        never, instead = _EAGER_ONLY[resolved.point]
        problems.append(BackendError(fix(
            f"{resolved} is {'read' if resolved.info.read_only else 'read and written'} on the eager backend only: "
            f"{model.capabilities.backend}'s fused kernels never "
            f"form {never}.", f'load with load_model({model.name!r}, backend="eager"), or read {instead} here.')))
        return None
    served = model.capabilities.served
    if served is not None and resolved.point not in served:
        has = ", ".join(p for p in POINTS if p in served)
        problems.append(PointError(fix(
            f"{model.name!r} is served as {model.arch.family}, which has {has} only: {resolved.point} needs a table "
            "of where each point sits in its layers.",
            f"read or edit one of those points, or use a model of a family that has {resolved.point}: "
            f"{', '.join(families_with(resolved.point))}.")))
        return None
    return resolved


def _check_value(op, name: str, shape: tuple[int, ...], address: Address, feat: tuple[int, ...],
                 n_prompts: int, problems: list, own: tuple = ()) -> None:
    if 0 in shape:
        problems.append(SpecError(fix(f"{type(op).__name__} at {address}: {name} has shape {shape}, with an empty "
                                      "axis, so it holds no value to write.",
                                      f"pass a {name} of shape {feat} (one position), or the whole point with every "
                                      "axis at least 1.")))
        return
    if address.point != "attn_scores" and bool(getattr(op, name).tensor.isneginf().any()):
        problems.append(SpecError(fix(f"{type(op).__name__} at {address}: {name} contains -inf, which only "
                                      "attn_scores can hold (a masked key).",
                                      f"clean it first, e.g. torch.nan_to_num({name}).")))
    if shape == feat and address.info.pos_axis == 1:
        return
    full = len(shape) == len(feat) + 2
    if full:
        pa = address.info.pos_axis
        rest = tuple(s for i, s in enumerate(shape) if i not in (0, pa))
        rest_ok = rest == feat if pa == 1 else (rest[0] == feat[0] and rest[1] >= feat[1])
        if shape[0] in (1, n_prompts) and rest_ok:
            return
    axes = " ".join(a for a in address.info.axes if a not in ("batch", "pos", "q_pos"))
    whole = "1" if n_prompts == 1 else f"{n_prompts} or 1"
    if address.info.pos_axis == 1:
        remedy = f"pass a {name} of shape {feat} (one position: {axes}), or the whole point ({whole}, pos, ...) as " \
                 "a capture returns it."
    else:  # attention patterns have no per-position form: one query row depends on the keys it sees
        remedy = f"pass the whole point ({whole}, {feat[0]}, q_pos, k_pos) as a capture returns it, e.g. an edited " \
                 f'copy of capture(model, tokens, ["{address}"])["{address}"].'
    problems.append(SpecError(fix(
        f"{type(op).__name__} at {address}: {name} has shape {shape}, but {address.point} holds {feat} per position"
        + (f" (layer {address.layer}'s own widths: {', '.join(f'{n} {v}' for n, v in own)})." if own else "."),
        remedy)))


def _compiled_clamp(op, address: Address, taps) -> BackendError | None:
    """Why vllm-static cannot run this Clamp or Splice inside its compiled graph (None: it can)."""
    if isinstance(op, Clamp) and taps is not None and address in taps.clamps:
        if not op.sae.acts_per_feature and not any(s.key == op.sae.key for s in taps.splices):
            return BackendError(fix(
                f"Clamp at {address} with a {op.sae.activation} SAE (normalize={op.sae.normalize}) this engine was not "
                "loaded with: its features need the SAE's whole encode (a row's top k, its input scale), which the "
                "graph holds only for the SAEs declared at load.",
                'declare it: load_model(..., backend="vllm-static", static_writes=[..., sae]) (a reload; its encode '
                'then runs at every row of every step, as for S.Splice(sae)); or use backend="vllm".'))
        if len(set(op.features)) > CLAMP_SLOTS:
            return BackendError(fix(f"Clamp at {address} of {len(set(op.features))} features: the compiled clamp "
                                    f"holds {CLAMP_SLOTS}.", f'clamp at most {CLAMP_SLOTS}, or use backend="vllm".'))
        return None
    if isinstance(op, Splice) and taps is not None and any(s.key == op.sae.key for s in taps.splices):
        return None
    declared = ", ".join(map(str, taps.clamps)) if taps is not None and taps.clamps else "none"
    if isinstance(op, Splice):
        return BackendError(fix(
            f"Splice at {address} with an SAE this vllm-static engine was not loaded with: a compiled splice holds "
            f"the weights of the SAEs declared for it at load (here {len(taps.splices) if taps else 0}).",
            'declare it at load: load_model(..., backend="vllm-static", static_writes=[..., S.Splice(sae)]) (a '
            'reload); or use backend="vllm" (per request) or "eager".'))
    return BackendError(fix(
        f"Clamp at {address} encodes with an SAE, which a compiled tap's per-row (mul, add) cannot express; this "
        f"engine compiles clamps at [{declared}].",
        'declare an SAE of that point at load: load_model(..., backend="vllm-static", static_writes=[..., sae]); or '
        'use backend="vllm" (per request) or "eager"; S.steer_feature(sae, i, scale) (an Add of a decoder row) '
        "compiles."))


def _check_sae(sae: SAE, address: Address, model, problems: list) -> None:
    """An SAE against the point it reads in this model: a per-position point, d_in values wide."""
    if address.info.pos_axis != 1:
        problems.append(SpecError(fix(f"an SAE reads one vector per position; {address} is an attention pattern.",
                                      "use an SAE trained on a per-position point (resid_post, mlp_out, z, ...).")))
        return
    width = 1
    for s in feature_shape(address, model.dims, 1):
        width *= s
    if sae.d_in != width:
        problems.append(SpecError(fix(
            f"the SAE reads {sae.d_in} values per position, but {address} of {model.name!r} holds {width}.",
            f"use an SAE trained on {address.point} of this model (d_in={width}), or the point it was trained on.")))


def _largest(t) -> float:
    """The largest finite magnitude in `t` (-inf in attention scores is a masked key, not a size), in slices."""
    flat = t.reshape(-1)
    return max((float(c.abs().masked_fill(c.isinf(), 0).amax()) for c in flat.split(1 << 22) if c.numel()),
               default=0.0)


def _check_range(op, address: Address, dtype, problems: list) -> None:
    """Refuse an op whose own numbers overflow the model's dtype: the edit would write inf, then NaN downstream
    (garbage on every backend, and eager's sampler cannot draw from NaN logits)."""
    if not isinstance(dtype, torch.dtype) or dtype not in SPEC_DTYPES.values():
        return
    top = torch.finfo(dtype).max
    if isinstance(op, Scale):
        size, what = abs(op.factor), f"factor {op.factor:g}"
    elif isinstance(op, Add):
        size = abs(op.scale) * _largest(op.vector.tensor)
        what = f"scale * vector reaches {size:g}"
    elif isinstance(op, Set | Patch):
        size = _largest((op.value if isinstance(op, Set) else op.source).tensor)
        what = f"{'value' if isinstance(op, Set) else 'source'} reaches {size:g}"
    else:
        return
    if size > top:
        problems.append(SpecError(fix(f"{type(op).__name__} at {address}: {what}, past the largest {dtype} "
                                      f"({top:g}): the edit would write inf.",
                                      f"keep the op's numbers within +-{top:g} (the model's dtype is {dtype}).")))


def _check_positions(positions: Positions, address: Address, n_prompts: int, longest: int, generating: bool,
                     problems: list) -> None:
    if positions.kind == "per_prompt":
        if len(positions.per_prompt) != n_prompts:
            problems.append(SpecError(fix(f"positions at {address} give {len(positions.per_prompt)} entries for {n_prompts} prompts.",
                                "give one positions entry per prompt.")))
        for p in positions.per_prompt:
            _check_positions(p, address, n_prompts, longest, generating, [] if generating else problems)
    elif positions.kind == "indices" and not generating:
        bad = [i for i in positions.indices if i >= longest or i < -longest]
        if bad:
            problems.append(SpecError(fix(f"positions {shown(bad)} at {address} are past the end of every prompt (the longest has "
                                f"{longest} tokens).", f"use indices in -{longest}..{longest - 1}.")))


def plan(model, spec: Spec, reads: Iterable[Address], *, n_prompts: int, longest: int,
         purpose: str = "forward") -> Plan:
    """Resolve and check a spec and a read list against `model`; raise one error naming every problem."""
    problems: list = []
    generating = purpose == "generate"
    reads = list(reads)
    capabilities = model.capabilities
    taps = capabilities.taps  # on vllm-static: only the declared points
    if not capabilities.points and (spec.ops or reads):
        raise BackendError(fix('backend="vllm-generate" is plain vLLM: no taps, so no capture and no steering.',
                               f'load_model({model.name!r}, backend="vllm") serves any point per request, '
                               'and backend="eager" every point with gradients.'))
    ops: dict[Address, list] = {}
    for op in spec.ops:
        address = _resolve(op.point, model, problems)
        if address is None:
            continue
        if generating and address.info.needs_eager_attention:
            problems.append(SpecError(fix(f"{address} cannot be edited while generating: the pattern grows every step.",
                                "edit q/k/v instead, or steer() the full sequence.")))
        if generating and address.point in ("k", "v") and model.dims.d_latent:
            problems.append(SpecError(fix(f"{address} cannot be edited while generating on {model.arch.family}: its "
                                          "cache holds the latent, from which every step expands k and v afresh, so "
                                          "an edit of an earlier step's k or v would be lost.",
                                          f"edit kv_latent.{address.layer} (what the cache holds), or steer() the "
                                          "full sequence.")))
        if address.info.read_only:
            why, how = _READ_ONLY[address.point]
            problems.append(SpecError(fix(f"{address} is read-only: {why}.", how.format(L=address.layer))))
        if address.point in capabilities.read_only:
            problems.append(BackendError(fix(
                f"{address} is read-only on backend=\"{capabilities.backend}\" for {model.arch.family}: "
                f"{capabilities.read_only_why}.",
                f'load with load_model({model.name!r}, backend="eager") to edit {address.point}.')))
        if address.info.eager_only_write and not capabilities.eager_only_writes:
            problems.append(BackendError(fix(f"{address} can be written only on the eager backend.",
                                             'use backend="eager" to edit it.')))
        if isinstance(op, Ablate) and op.how == "mean" and not capabilities.mean_ablation:
            problems.append(BackendError(fix(
                f"Ablate(how=\"mean\") at {address} averages over the call's batch, which vLLM's continuous "
                "batching splits across steps, so the mean would depend on scheduling.",
                f'compute the mean once and set it: m = capture(model, reference_prompts, ["{address}"])'
                f'["{address}"].mean((0, 1)); S.Set("{address}", m) (or use backend="eager").')))
        if isinstance(op, Custom) and not capabilities.custom_ops:
            problems.append(BackendError(fix(f"Custom at {address} holds a Python function, which never crosses into a vLLM "
                                "worker.", 'use backend="eager" for Custom ops, or express it with Add/Set/Scale/Ablate.')))
        # A point read-only here is refused above: declaring it in static_writes is refused too, so not offered.
        if taps is not None and address.point not in capabilities.read_only and \
                (refused := taps.refusal(address, write=True)) is not None:
            problems.append(refused)
        feat = feature_shape(address, model.dims, longest)
        if isinstance(op, Clamp | Splice):
            home = _resolve(op.sae.reads, model, [])
            if home is not None and home != address:
                problems.append(SpecError(fix(f"{type(op).__name__} at {address}, but its SAE reads {home}.",
                                              f"leave point= unset: {type(op).__name__}(sae, ...) acts at the SAE's point.")))
            if not capabilities.feature_edits and (refused := _compiled_clamp(op, address, taps)) is not None:
                problems.append(refused)
            _check_sae(op.sae, address, model, problems)
        if isinstance(op, Add | Set | Patch):
            name = {Add: "vector", Set: "value", Patch: "source"}[type(op)]
            own = model.dims.layer_sizes[address.layer] if model.dims.layer_sizes and address.layer is not None else ()
            _check_value(op, name, getattr(op, name).shape, address, feat, n_prompts, problems, own)
        heads = getattr(op, "heads", None)
        if heads is not None:
            axis = address.info.head_axis
            if axis is None:
                problems.append(SpecError(fix(f"{type(op).__name__} at {address} names heads, but {address.point} has no "
                                    "head axis.", "drop heads=, or target q, k, v, z, attn_scores, attn_probs "
                                    "or a linear-attention point (lin_q ... lin_out).")))
            else:
                count = getattr(model.dims.at(address.layer), address.info.axes[axis])
                bad = [h for h in heads if not 0 <= h < count]
                if bad:
                    problems.append(PointError(fix(f"heads {bad} at {address} do not exist: {address.point} has {count} heads.",
                                        f"use head indices in 0..{count - 1}.")))
        _check_range(op, address, getattr(model, "dtype", None), problems)
        _check_positions(op.positions, address, n_prompts, longest, generating, problems)
        ops.setdefault(address, []).append(op)
    if not capabilities.feature_edits:  # a compiled clamp or splice runs after its point's (mul, add) tap
        for address, listed in ops.items():
            if any(isinstance(o, Clamp | Splice) for o in listed[:-1]):
                problems.append(BackendError(fix(
                    f"at {address} a Clamp or Splice comes before another op; vllm-static's compiled clamp and "
                    "splice run after the point's other edits, one of them per call.", f"put one Clamp or Splice last "
                    f'among the ops at {address} (several features in one Clamp), or use backend="vllm".')))
    resolved_reads = []
    for address in reads:
        sae = address.sae if isinstance(address, Features) else None
        resolved = _resolve(Address.parse(address if sae is None else sae.reads), model, problems)
        if resolved is not None and sae is not None:
            _check_sae(sae, resolved, model, problems)
        if resolved is None:
            continue
        if generating and resolved.info.needs_eager_attention:
            problems.append(SpecError(fix(f"{resolved} cannot be captured while generating: the pattern grows every step.",
                                "capture it afterwards: capture(model, out.sequences, [...]).")))
        if taps is not None and (refused := taps.refusal(resolved, write=False)) is not None:
            problems.append(refused)
        resolved_reads.append(resolved)
    if len(problems) == 1:
        raise problems[0]
    if problems:
        listed = "\n".join(f"{i}. {p}" for i, p in enumerate(problems, 1))
        raise SpecError(f"{len(problems)} problems with this request (nothing was run):\n{listed}")
    return Plan({a: tuple(o) for a, o in ops.items()}, tuple(dict.fromkeys(resolved_reads)))
