"""Intervention specs are data: frozen, hashable ops in an ordered `Spec`.

Ops are nouns (`Add`, `Set`, `Scale`, `Ablate`, `Patch`); tensors inside them compare and hash by content
digest; `to_dict`/`from_dict` round-trip through JSON and never name code. `Custom` (a user function) is the
one escape hatch: eager only, never serialised.
"""

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union

import torch

from interp_engine.addresses import Address
from interp_engine.errors import InputTypeError, InterpEngineError, SpecError, fix
# Re-exported: a spec's tensors and positions are part of what `interp_engine.spec` offers.
from interp_engine.positions import ALL, LAST, Positions, PositionKind  # noqa: F401
from interp_engine.sae import SAE
from interp_engine.tensor_data import (FLOAT_DTYPES, MAX_INDEX, MAX_NDIM, SPEC_DTYPES, TensorData,  # noqa: F401
                                       is_index, shown)

# -------------------------------------------------------------------------------------------------- ops


def _norm_point(obj: Any) -> None:
    object.__setattr__(obj, "point", Address.parse(obj.point))


def _norm_heads(obj: Any) -> None:
    heads = obj.heads
    if heads is None:
        return
    if isinstance(heads, int) and not isinstance(heads, bool):
        heads = (heads,)
    if not isinstance(heads, Sequence) or not heads or not all(is_index(h) for h in heads):
        raise SpecError(fix(f"heads={shown(obj.heads)} is not a list of head indices.", "write heads=[0, 3]."))
    object.__setattr__(obj, "heads", tuple(heads))


def _norm_positions(obj: Any) -> None:
    object.__setattr__(obj, "positions", Positions.of(obj.positions))


def _norm_number(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(fix(f"{type(obj).__name__}.{name} must be a number, got {value!r}.", f"write {name}=2.0."))
    try:
        number = float(value)
    except OverflowError:
        number = float("inf")
    if number != number or number in (float("inf"), float("-inf")):
        raise SpecError(fix(f"{type(obj).__name__}.{name} is {shown(value)}, not a finite float.",
                            f"use a finite {name}."))
    object.__setattr__(obj, name, number)


@dataclass(frozen=True, slots=True)
class Add:
    """Add `scale * vector` at `point` (vector shaped like one position of the point, or the whole point)."""

    point: Address
    vector: TensorData
    scale: float = 1.0
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        object.__setattr__(self, "vector", TensorData.of(self.vector, what="vector"))
        _norm_number(self, "scale")
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Set:
    """Replace the activation at `point` with `value` (one position's shape, or the whole point's)."""

    point: Address
    value: TensorData
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        object.__setattr__(self, "value", TensorData.of(self.value, what="value"))
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Scale:
    """Multiply the activation at `point` by `factor` (only `heads`, where the point has heads)."""

    point: Address
    factor: float
    heads: tuple[int, ...] | None = None
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        _norm_number(self, "factor")
        _norm_heads(self)
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Ablate:
    """Zero the activation, or replace it by its mean over this run's batch and positions."""

    point: Address
    how: Literal["zero", "mean"] = "zero"
    heads: tuple[int, ...] | None = None
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        if self.how not in ("zero", "mean"):
            raise SpecError(fix(f"Ablate(how={self.how!r}) is not a kind of ablation.", 'use how="zero" or how="mean".'))
        _norm_heads(self)
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Patch:
    """Replace the activation at `point` with the one another run stored in `source` (a Cache)."""

    point: Address
    source: TensorData
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        source = self.source
        if hasattr(source, "get_tensor"):  # a Cache: keep only the tensor this op needs
            source = source.get_tensor(self.point)
        object.__setattr__(self, "source", TensorData.of(source, what="Patch source"))
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Custom:
    """Eager-only escape hatch: `fn(activation) -> activation`. Never serialised, refused by vLLM."""

    point: Address
    fn: Callable[[torch.Tensor], torch.Tensor] = field(compare=False)
    positions: Positions = ALL

    def __post_init__(self):
        _norm_point(self)
        if not callable(self.fn):
            raise InputTypeError(fix(f"Custom.fn must be callable, got {type(self.fn).__name__}.",
                                     "pass a function tensor -> tensor."))
        _norm_positions(self)

    def __hash__(self) -> int:
        return hash((self.point, id(self.fn), self.positions))


def _norm_sae(obj: Any) -> None:
    if not isinstance(obj.sae, SAE):
        raise InputTypeError(fix(f"{type(obj).__name__}.sae must be an SAE, got {type(obj.sae).__name__}.",
                                 "load one: sae = load_sae(path)."))
    if obj.sae.writes is not None:
        raise SpecError(fix(f"{type(obj).__name__} with a transcoder ({obj.sae.reads} -> {obj.sae.writes}) would "
                            "need the features of one point at another; not served yet.",
                            f"capture [sae.features] and write the result with Add/Set at {obj.sae.writes}."))
    object.__setattr__(obj, "point", Address.parse(obj.sae.reads if obj.point is None else obj.point))


@dataclass(frozen=True, slots=True)
class Clamp:
    """Set SAE features to `to` at the SAE's point, keeping the SAE's error term:
    `x + (to - f_i(x)) * W_dec[i]` for each feature i (normalisation undone). `to=0` ablates them."""

    sae: SAE
    features: tuple[int, ...]
    to: float = 0.0
    positions: Positions = ALL
    point: Address | None = None  # the SAE's point; set only by the backends, to the resolved address

    def __post_init__(self):
        _norm_sae(self)
        features = (self.features,) if is_index(self.features) else self.features
        if not isinstance(features, Sequence) or not features or not all(is_index(f) for f in features):
            raise SpecError(fix(f"features={shown(self.features)} is not a list of feature indices.",
                                "write features=[12] or features=[3, 7]."))
        bad = [f for f in features if not 0 <= f < self.sae.d_sae]
        if bad:
            raise SpecError(fix(f"features {shown(bad)} do not exist: this SAE has {self.sae.d_sae} features.",
                                f"use feature indices in 0..{self.sae.d_sae - 1}."))
        object.__setattr__(self, "features", tuple(dict.fromkeys(features)))
        _norm_number(self, "to")
        _norm_positions(self)


@dataclass(frozen=True, slots=True)
class Splice:
    """Replace the activation at the SAE's point with its reconstruction; `error=True` adds the error term back
    (`x_hat + (x - x_hat)`: the same values, but gradients flow through the features)."""

    sae: SAE
    error: bool = False
    positions: Positions = ALL
    point: Address | None = None

    def __post_init__(self):
        _norm_sae(self)
        if not isinstance(self.error, bool):
            raise SpecError(fix(f"Splice.error must be True or False, got {shown(self.error)}.", "write error=True."))
        _norm_positions(self)


def steer_feature(sae: SAE, feature: int, scale: float = 1.0, positions: Any = ALL) -> "Add":
    """Add `scale` times feature `feature`'s decoder direction at the SAE's point: an `Add` of W_dec[feature]."""
    if not is_index(feature) or not 0 <= feature < sae.d_sae:
        raise SpecError(fix(f"feature {shown(feature)} does not exist: this SAE has {sae.d_sae} features.",
                            f"use a feature index in 0..{sae.d_sae - 1}."))
    return Add(sae.writes or sae.reads, sae.W_dec.tensor[feature].reshape(-1), scale=scale, positions=positions)


Op = Union[Add, Set, Scale, Ablate, Patch, Clamp, Splice, Custom]
OP_TYPES: dict[str, type] = {t.__name__: t for t in (Add, Set, Scale, Ablate, Patch, Clamp, Splice)}

# ------------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True, slots=True)
class Spec:
    """An ordered tuple of ops. Edits at one point apply in order; captures read after all of them."""

    ops: tuple[Op, ...] = ()

    def __post_init__(self):
        ops = tuple(self.ops) if isinstance(self.ops, Sequence) else self.ops
        if not isinstance(ops, tuple) or not all(isinstance(o, Op.__args__) for o in ops):
            raise InputTypeError(fix("Spec holds ops (Add, Set, Scale, Ablate, Patch, Clamp, Splice, Custom) only.",
                                     "build it as Spec((Add(...), Scale(...))) or Add(...) + Scale(...)."))
        object.__setattr__(self, "ops", ops)

    def __add__(self, other: "Spec | Op") -> "Spec":
        return Spec(self.ops + as_spec(other).ops)

    def __len__(self) -> int:
        return len(self.ops)

    def __iter__(self):
        return iter(self.ops)

    @property
    def has_custom(self) -> bool:
        return any(isinstance(o, Custom) for o in self.ops)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (tensors as base64 bytes with dtype and shape)."""
        return self._encode(TensorData.to_dict)

    def _encode(self, tensor: Callable[[TensorData], Any]) -> dict[str, Any]:
        out = []
        for op in self.ops:
            if isinstance(op, Custom):
                raise SpecError(fix("a Custom op holds a Python function and cannot be serialised.",
                                    "express the edit with Add/Set/Scale/Ablate/Patch, or keep it in-process."))
            d: dict[str, Any] = {"op": type(op).__name__}
            for f in fields(op):
                value = getattr(op, f.name)
                if isinstance(value, Address):
                    value = str(value)
                elif isinstance(value, TensorData):
                    value = tensor(value)
                elif isinstance(value, SAE):
                    value = value.encoded(tensor)
                elif isinstance(value, Positions):
                    value = value.to_dict()
                elif isinstance(value, tuple):
                    value = list(value)
                d[f.name] = value
            out.append(d)
        return {"interp_engine_spec": 1, "ops": out}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Spec":
        """Rebuild a spec from `to_dict` output. Only the op names of OP_TYPES are accepted; nothing is executed."""
        return cls._decode(d, None)

    @classmethod
    def from_validated_dict(cls, d: Mapping[str, Any], *, fingerprint: str) -> "Spec":
        """`from_dict` for a dict that a `Spec` in the sending process wrote (a vLLM worker's table): the same
        gate (op names, fields, dtype names, shapes and sizes), without re-checking tensor values or hashing
        their bytes again. Each tensor's identity is `fingerprint` (the sender's `Spec.fingerprint()`) and its
        place in the spec."""
        return cls._decode(d, fingerprint)

    @classmethod
    def _decode(cls, d: Mapping[str, Any], fingerprint: str | None) -> "Spec":
        if not isinstance(d, Mapping) or d.get("interp_engine_spec") != 1 or not isinstance(d.get("ops"), list):
            raise SpecError(fix("this is not a spec dict (missing 'interp_engine_spec': 1 and 'ops').",
                                "pass what Spec.to_dict() returned, e.g. Spec.from_dict(json.load(f))."))
        if len(d) != 2:
            extra = sorted(shown(k) for k in d if k not in ("interp_engine_spec", "ops"))
            raise SpecError(fix(f"this spec dict has unknown keys {', '.join(extra)}.",
                                "a spec dict holds 'interp_engine_spec' and 'ops' only; pass what Spec.to_dict() "
                                "returned."))
        ops = []
        for i, raw in enumerate(d["ops"]):
            kind = raw.get("op") if isinstance(raw, Mapping) else None
            op_type = OP_TYPES.get(kind) if isinstance(kind, str) else None
            if op_type is None:
                raise SpecError(fix(f"ops[{i}] has unknown op {kind!r}.", f"use one of {', '.join(OP_TYPES)}."))
            names = {f.name: f for f in fields(op_type)}
            unknown = set(raw) - set(names) - {"op"}
            if unknown:
                raise SpecError(fix(f"ops[{i}] ({kind}) has unknown fields {sorted(unknown, key=str)}.",
                                    f"{kind} takes {', '.join(names)}."))
            try:
                kwargs: dict[str, Any] = {}
                for name, value in raw.items():
                    if name in ("vector", "value", "source"):
                        value = TensorData.from_dict(value, what=f"ops[{i}].{name}", digest=None if fingerprint
                                                     is None else f"{fingerprint}:{i}.{name}")
                    elif name == "sae":
                        value = SAE.decoded(value, what=f"ops[{i}].sae", digest=None if fingerprint is None
                                            else f"{fingerprint}:{i}.sae")
                    elif name == "positions":
                        value = Positions.from_dict(value)
                    if name != "op":
                        kwargs[name] = value
                ops.append(op_type(**kwargs))
            except InterpEngineError:
                raise
            except (TypeError, ValueError, AttributeError, KeyError) as e:
                raise SpecError(fix(f"ops[{i}] ({kind}) is malformed: {e}.",
                                    "pass what Spec.to_dict() wrote, unchanged.")) from None
        return cls(tuple(ops))

    def fingerprint(self) -> str:
        """A stable content hash: same ops, same vectors -> same fingerprint, in any process."""
        if self.has_custom:
            raise SpecError(fix("a spec with a Custom op has no stable fingerprint.", "use data ops only."))
        # Tensors by the content digest they already carry: nothing is encoded or hashed twice.
        content = self._encode(lambda t: {"dtype": str(t.tensor.dtype).removeprefix("torch."), "shape": list(t.shape),
                                          "digest": t.digest})
        return hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:24]

    def points(self) -> tuple[Address, ...]:
        return tuple(dict.fromkeys(op.point for op in self.ops))


def _op_add(self: Any, other: "Spec | Op") -> Spec:
    return Spec((self,)) + other


for _t in (Add, Set, Scale, Ablate, Patch, Clamp, Splice, Custom):
    _t.__add__ = _op_add


def as_spec(value: "Spec | Op | Sequence[Op] | None") -> Spec:
    if value is None:
        return Spec()
    if isinstance(value, Spec):
        return value
    if isinstance(value, Op.__args__):
        return Spec((value,))
    if isinstance(value, Sequence) and not isinstance(value, str):
        return Spec(tuple(value))
    raise InputTypeError(fix(f"spec must be a Spec, an op or a list of ops, got {type(value).__name__}.",
                             'write spec=S.Add("resid_post.3", vector) or spec=Spec((op1, op2)).'))
