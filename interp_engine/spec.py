"""Intervention specs are data: frozen, hashable ops in an ordered `Spec`.

Ops are nouns (`Add`, `Set`, `Scale`, `Ablate`, `Patch`); tensors inside them compare and hash by content
digest; `to_dict`/`from_dict` round-trip through JSON and never name code. `Custom` (a user function) is the
one escape hatch: eager only, never serialised.
"""

import base64
import binascii
import hashlib
import json
import reprlib
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
# What a spec tensor may hold: the floats every backend can scan for NaN and cast on CPU. float8 and the other
# narrow floats have no CPU kernels for those scans (torch.isposinf raises), so a spec refuses them by name.
SPEC_DTYPES: dict[str, torch.dtype] = {name: t for name, t in FLOAT_DTYPES.items()
                                        if t in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
# Bounds on sizes and indices read from data: far above any model (2**31 positions, heads or layers), far below
# where torch's int64 arithmetic overflows, and short enough to print in a message.
MAX_INDEX = 2**31 - 1
MAX_NDIM = 8
_CHUNK = 4 << 20  # base64 characters decoded at a time (a multiple of 4): the only copy beside the tensor


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlong = 3, 40


def shown(value: Any, limit: int = 80) -> str:
    """repr for a message, short; never fails (Python refuses to print ints of more than 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = _SHORT.repr(value)  # reprlib: nested lists to three levels, so a deep one never recurses
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_index(value: Any) -> bool:
    """An int (not a bool) within +-MAX_INDEX."""
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_INDEX <= value <= MAX_INDEX


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
        if value.dtype not in SPEC_DTYPES.values():
            narrow = " (a float without the CPU kernels a spec's checks need)" if value.is_floating_point() else ""
            raise SpecError(fix(f"{what} has dtype {value.dtype}{narrow}; edits need a floating-point tensor: "
                                "float16, bfloat16, float32 or float64.",
                                f"pass {what}.float() (it is cast to the model dtype at run time)."))
        t = value.detach().cpu().contiguous()
        flat = t.reshape(-1)
        # In slices, so that a large vector costs no second full-size (bool) tensor.
        if any(bool(torch.isnan(c).any()) or bool(torch.isposinf(c).any()) for c in flat.split(1 << 22)):
            raise SpecError(fix(f"{what} contains NaN or +inf; it would poison every later activation.",
                                f"clean it first, e.g. torch.nan_to_num({what})."))
        h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(flat.view(torch.uint8).numpy())  # the buffer itself, not a bytes copy
        return cls(t, h.hexdigest()[:32])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_dict(self) -> dict[str, Any]:
        raw = self.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"dtype": str(self.tensor.dtype).removeprefix("torch."), "shape": list(self.shape),
                "data": base64.b64encode(raw).decode("ascii")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, what: str) -> "TensorData":
        remedy = "pass the {dtype, shape, data} dict that Spec.to_dict() wrote, unchanged."
        if not isinstance(d, Mapping) or not {"dtype", "shape", "data"} <= set(d):
            raise SpecError(fix(f"{what} is not a tensor dict (dtype, shape, data).", remedy))
        if len(d) != 3:
            extra = sorted(shown(k) for k in d if k not in ("dtype", "shape", "data"))
            raise SpecError(fix(f"{what} has unknown keys {', '.join(extra)}; a tensor dict holds dtype, shape and "
                                "data only.", remedy))
        # A fixed table, not getattr(torch, name): a name read from a file never reaches an attribute lookup.
        dtype = SPEC_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise SpecError(fix(f"{what}: tensor dtype {shown(d['dtype'])} is not one a spec holds.",
                                'use "float32", "float16", "bfloat16" or "float64" (float8 vectors: store them as '
                                'float32; they are cast to the model dtype at run time).'))
        shape, data = d["shape"], d["data"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_INDEX for s in shape):
            raise SpecError(fix(f"{what}: shape {shown(shape)} is not a list of at most {MAX_NDIM} sizes in "
                                f"0..{MAX_INDEX}.", remedy))
        if not isinstance(data, str):
            raise SpecError(fix(f"{what}: data is a {type(data).__name__}, not a base64 string.", remedy))
        size = dtype.itemsize
        for s in shape:
            size *= s
        # Checked before decoding: a payload of the wrong length never costs its decoded size in memory.
        if len(data) != 4 * -(-size // 3):
            raise SpecError(fix(f"{what}: {len(data)} base64 characters, but shape {shape} of {d['dtype']} is {size} "
                                f"bytes ({4 * -(-size // 3)} characters).", remedy))
        raw = torch.empty(size, dtype=torch.uint8)
        out, at = raw.numpy(), 0
        try:
            for i in range(0, len(data), _CHUNK):
                piece = binascii.a2b_base64(data[i:i + _CHUNK], strict_mode=True)
                if at + len(piece) > size:
                    raise ValueError("more bytes than the shape holds")
                out[at:at + len(piece)] = memoryview(piece)
                at += len(piece)
            if at != size:
                raise ValueError(f"{at} bytes of data for {size}")
        except (ValueError, TypeError) as e:
            raise SpecError(fix(f"{what}: data is not the base64 of {size} bytes ({e}).", remedy)) from None
        return cls.of(raw.view(dtype).reshape(shape), what=what)


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
            return cls("indices", indices=(_position(value),))
        if isinstance(value, slice):
            parts = (value.start, value.stop, value.step)
            if not all(p is None or (isinstance(p, int) and not isinstance(p, bool)) for p in parts):
                raise SpecError(fix(f"positions slice {shown(value)} must hold ints or None.", "e.g. slice(2, None)."))
            for p in parts:
                if p is not None:
                    _position(p)
            if value.step is not None and value.step <= 0:
                raise SpecError(fix(f"positions slice step must be positive, got {value.step}.", "use slice(a, b, 1)."))
            return cls("slice", start=value.start, stop=value.stop, step=value.step)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, Sequence) and not isinstance(value, str):
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                if not value:
                    raise SpecError(fix("positions=[] selects nothing.", 'use "all", "last" or at least one index.'))
                return cls("indices", indices=tuple(_position(v) for v in value))
            value = [v.tolist() if isinstance(v, torch.Tensor) else v for v in value]
            # Checked before reading the entries: a deeply nested list is refused at its second level, never
            # recursed into (which would end in a RecursionError).
            if any(_is_list(v) and not all(isinstance(x, int) and not isinstance(x, bool) for x in v) for v in value) \
                    or any(isinstance(v, Positions) and v.kind == "per_prompt" for v in value):
                raise SpecError(fix(f"positions {shown(value)} nest one list per prompt inside another.",
                                    'give one entry per prompt, each "all", "last", an int, a list of ints or a slice.'))
            return cls("per_prompt", per_prompt=tuple(cls.of(v) for v in value))
        raise SpecError(fix(f"cannot read positions from {shown(value)}.",
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
        if isinstance(d, Mapping):
            if len(d) != 1 or not ({"slice", "per_prompt"} & set(d)):
                raise SpecError(fix(f"positions {shown(d)} has keys {sorted(shown(k) for k in d)}; a positions dict "
                                    'holds one key, "slice" or "per_prompt".',
                                    'write {"slice": [start, stop, step]} or {"per_prompt": [...]}.'))
            if "slice" in d:
                if not isinstance(d["slice"], list) or len(d["slice"]) != 3:
                    raise SpecError(fix(f"positions {shown(d)} is not a slice.",
                                        'write {"slice": [start, stop, step]}.'))
                return cls.of(slice(*d["slice"]))
            entries = d["per_prompt"]
            if not isinstance(entries, list) or any(isinstance(p, Mapping) and "per_prompt" in p for p in entries):
                raise SpecError(fix(f"positions {shown(d)} is not one entry per prompt.",
                                    'write {"per_prompt": [entry, ...]}, each entry "all", "last", an int, a list of '
                                    'ints or a slice dict.'))
            return cls.of([cls.from_dict(p) if isinstance(p, Mapping) else p for p in entries])
        return cls.of(d)


ALL = Positions("all")
LAST = Positions("last")


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _position(value: int) -> int:
    if not is_index(value):
        raise SpecError(fix(f"position {shown(value)} is past any prompt: positions lie within +-{MAX_INDEX}.",
                            "use an index within the prompt (negative counts from the end), or None in a slice "
                            "for \"to the end\"."))
    return value

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
                    value = value.to_dict()
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
                        value = TensorData.from_dict(value, what=f"ops[{i}].{name}")
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
        digest = json.dumps(_strip_data(self.to_dict()), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(digest.encode()).hexdigest()[:24]

    def points(self) -> tuple[Address, ...]:
        return tuple(dict.fromkeys(op.point for op in self.ops))


def _strip_data(d: Any) -> Any:
    if isinstance(d, dict):
        if "data" in d and "shape" in d:
            return {**d, "data": hashlib.sha256(d["data"].encode()).hexdigest()}
        return {k: _strip_data(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_strip_data(v) for v in d]
    return d


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
