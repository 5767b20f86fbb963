"""Intervention specs are data: frozen, hashable ops in an ordered `Spec`.

Ops are nouns (`Add`, `Set`, `Scale`, `Ablate`, `Patch`); tensors inside them compare and hash by content
digest; `to_dict`/`from_dict` round-trip through JSON and never name code. `Custom` (a user function) is the
one escape hatch: eager only, never serialised.
"""

import base64
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Union

import torch

from interp_engine.addresses import Address
from interp_engine.errors import InputTypeError, InterpEngineError, SpecError, fix

# ---------------------------------------------------------------------------------------------- tensors

# Every floating dtype by its torch name ("float32", and aliases such as "float" and "half"), built once here.
FLOAT_DTYPES: dict[str, torch.dtype] = {name: t for name, t in vars(torch).items()
                                         if isinstance(t, torch.dtype) and t.is_floating_point}


@dataclass(frozen=True, slots=True)
class TensorData:
    """A tensor that compares and hashes by content (dtype, shape, bytes)."""

    tensor: torch.Tensor = field(compare=False, repr=False)
    digest: str = ""

    @classmethod
    def of(cls, value: Any, *, what: str) -> "TensorData":
        if isinstance(value, TensorData):
            return value
        if not isinstance(value, torch.Tensor):
            raise InputTypeError(fix(f"{what} must be a torch.Tensor, got {type(value).__name__}.",
                                     f"wrap it: torch.tensor(...), e.g. {what}=torch.randn(d_model)."))
        if not (value.is_floating_point()):
            raise SpecError(fix(f"{what} has dtype {value.dtype}; edits need a floating-point tensor.",
                                f"pass {what}.float() (it is cast to the model dtype at run time)."))
        t = value.detach().cpu().contiguous()
        if bool(torch.isnan(t).any()) or bool(torch.isposinf(t).any()):
            raise SpecError(fix(f"{what} contains NaN or +inf; it would poison every later activation.",
                                f"clean it first, e.g. torch.nan_to_num({what})."))
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return cls(t, h.hexdigest()[:32])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_dict(self) -> dict[str, Any]:
        raw = self.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"dtype": str(self.tensor.dtype).removeprefix("torch."), "shape": list(self.shape),
                "data": base64.b64encode(raw).decode("ascii")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, what: str, digest: str | None = None) -> "TensorData":
        """Rebuild a tensor from `to_dict` output, checking its dtype name, shape and size. With `digest` (a
        table the driver validated already: see `Spec.from_validated_dict`) the value checks and the content
        hash are skipped and `digest` is the tensor's identity."""
        remedy = "pass the {dtype, shape, data} dict that Spec.to_dict() wrote, unchanged."
        if not isinstance(d, Mapping) or not {"dtype", "shape", "data"} <= set(d):
            raise SpecError(fix(f"{what} is not a tensor dict (dtype, shape, data).", remedy))
        # A fixed table, not getattr(torch, name): a name read from a file never reaches an attribute lookup.
        dtype = FLOAT_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise SpecError(fix(f"{what}: unknown tensor dtype {d['dtype']!r}.",
                                'use a floating dtype name such as "float32" or "bfloat16".'))
        shape = d["shape"]
        try:
            if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                raise ValueError("shape must be a list of sizes")
            raw = bytearray(base64.b64decode(d["data"], validate=True))
            count = 1
            for s in shape:
                count *= s
            if len(raw) != count * dtype.itemsize:
                raise ValueError(f"{len(raw)} bytes of data for shape {shape} of {d['dtype']}")
        except (ValueError, TypeError) as e:
            raise SpecError(fix(f"{what} is malformed: {e}.", remedy)) from None
        t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape) if raw else \
            torch.empty(shape, dtype=dtype)
        if digest is not None:
            return cls(t, digest)  # `raw` is this tensor's own buffer: no copy needed
        return cls.of(t.clone(), what=what)


# -------------------------------------------------------------------------------------------- positions

PositionKind = Literal["all", "last", "indices", "slice", "per_prompt"]


@dataclass(frozen=True, slots=True)
class Positions:
    """Which positions an op touches. Negative indices count from the end of each prompt."""

    kind: PositionKind = "all"
    indices: tuple[int, ...] = ()
    start: int | None = None
    stop: int | None = None
    step: int | None = None
    per_prompt: tuple["Positions", ...] = ()

    @classmethod
    def of(cls, value: Any) -> "Positions":
        if isinstance(value, Positions):
            return value
        if value is None or value == "all":
            return ALL
        if value == "last":
            return LAST
        if isinstance(value, bool):
            raise SpecError(fix(f"positions={value!r} is ambiguous.", 'use "all", "last", an int, a list or a slice.'))
        if isinstance(value, int):
            return cls("indices", indices=(value,))
        if isinstance(value, slice):
            parts = (value.start, value.stop, value.step)
            if not all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts):
                raise SpecError(fix(f"positions slice {value!r} must hold ints or None.", "e.g. slice(2, None)."))
            if value.step is not None and value.step <= 0:
                raise SpecError(fix(f"positions slice step must be positive, got {value.step}.", "use slice(a, b, 1)."))
            return cls("slice", start=value.start, stop=value.stop, step=value.step)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, Sequence) and not isinstance(value, str):
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                if not value:
                    raise SpecError(fix("positions=[] selects nothing.", 'use "all", "last" or at least one index.'))
                return cls("indices", indices=tuple(value))
            entries = tuple(cls.of(v) for v in value)
            if any(e.kind == "per_prompt" for e in entries):
                raise SpecError(fix(f"positions {value!r} nest one list per prompt inside another.",
                                    'give one entry per prompt, each "all", "last", an int, a list of ints or a slice.'))
            return cls("per_prompt", per_prompt=entries)
        raise SpecError(fix(f"cannot read positions from {value!r}.",
                            'use "all", "last", an int, a list of ints, a slice, or one of those per prompt.'))

    def to_dict(self) -> Any:
        if self.kind in ("all", "last"):
            return self.kind
        if self.kind == "indices":
            return list(self.indices)
        if self.kind == "slice":
            return {"slice": [self.start, self.stop, self.step]}
        return {"per_prompt": [p.to_dict() for p in self.per_prompt]}

    @classmethod
    def from_dict(cls, d: Any) -> "Positions":
        if isinstance(d, Mapping) and "slice" in d:
            if not isinstance(d["slice"], list) or len(d["slice"]) != 3:
                raise SpecError(fix(f"positions {d!r} is not a slice.", 'write {"slice": [start, stop, step]}.'))
            return cls.of(slice(*d["slice"]))
        if isinstance(d, Mapping) and "per_prompt" in d:
            return cls.of([cls.from_dict(p) for p in d["per_prompt"]])
        return cls.of(d)


ALL = Positions("all")
LAST = Positions("last")

# -------------------------------------------------------------------------------------------------- ops


def _norm_point(obj: Any) -> None:
    object.__setattr__(obj, "point", Address.parse(obj.point))


def _norm_heads(obj: Any) -> None:
    heads = obj.heads
    if heads is None:
        return
    if isinstance(heads, int) and not isinstance(heads, bool):
        heads = (heads,)
    if not isinstance(heads, Sequence) or not heads or not all(isinstance(h, int) and not isinstance(h, bool)
                                                               for h in heads):
        raise SpecError(fix(f"heads={obj.heads!r} is not a list of head indices.", "write heads=[0, 3]."))
    object.__setattr__(obj, "heads", tuple(heads))


def _norm_positions(obj: Any) -> None:
    object.__setattr__(obj, "positions", Positions.of(obj.positions))


def _norm_number(obj: Any, name: str) -> None:
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError(fix(f"{type(obj).__name__}.{name} must be a number, got {value!r}.", f"write {name}=2.0."))
    if value != value or value in (float("inf"), float("-inf")):
        raise SpecError(fix(f"{type(obj).__name__}.{name} is {value}.", f"use a finite {name}."))
    object.__setattr__(obj, name, float(value))


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


Op = Union[Add, Set, Scale, Ablate, Patch, Custom]
OP_TYPES: dict[str, type] = {t.__name__: t for t in (Add, Set, Scale, Ablate, Patch)}

# ------------------------------------------------------------------------------------------------- spec


@dataclass(frozen=True, slots=True)
class Spec:
    """An ordered tuple of ops. Edits at one point apply in order; captures read after all of them."""

    ops: tuple[Op, ...] = ()

    def __post_init__(self):
        ops = tuple(self.ops) if isinstance(self.ops, Sequence) else self.ops
        if not isinstance(ops, tuple) or not all(isinstance(o, Op.__args__) for o in ops):
            raise InputTypeError(fix("Spec holds ops (Add, Set, Scale, Ablate, Patch, Custom) only.",
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
                elif isinstance(value, Positions):
                    value = value.to_dict()
                elif isinstance(value, tuple):
                    value = list(value)
                d[f.name] = value
            out.append(d)
        return {"interp_engine_spec": 1, "ops": out}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Spec":
        """Rebuild a spec from `to_dict` output. Only the five op names are accepted; nothing is executed."""
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
        ops = []
        for i, raw in enumerate(d["ops"]):
            kind = raw.get("op") if isinstance(raw, Mapping) else None
            op_type = OP_TYPES.get(kind) if isinstance(kind, str) else None
            if op_type is None:
                raise SpecError(fix(f"ops[{i}] has unknown op {kind!r}.", f"use one of {', '.join(OP_TYPES)}."))
            names = {f.name: f for f in fields(op_type)}
            unknown = set(raw) - set(names) - {"op"}
            if unknown:
                raise SpecError(fix(f"ops[{i}] ({kind}) has unknown fields {sorted(unknown)}.",
                                    f"{kind} takes {', '.join(names)}."))
            try:
                kwargs: dict[str, Any] = {}
                for name, value in raw.items():
                    if name in ("vector", "value", "source"):
                        value = TensorData.from_dict(value, what=f"ops[{i}].{name}", digest=None if fingerprint
                                                     is None else f"{fingerprint}:{i}.{name}")
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


for _t in (Add, Set, Scale, Ablate, Patch, Custom):
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
