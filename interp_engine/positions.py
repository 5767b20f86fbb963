"""Positions as data: which positions of each prompt an op touches (all, last, indices, a slice, or one of these
per prompt)."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from interp_engine.errors import SpecError, fix
from interp_engine.tensor_data import MAX_INDEX, is_index, shown

PositionKind = Literal["all", "last", "indices", "slice", "per_prompt"]
_KINDS = PositionKind.__args__


@dataclass(frozen=True, slots=True)
class Positions:
    """Which positions an op touches. Negative indices count from the end of each prompt."""

    kind: PositionKind = "all"
    indices: tuple[int, ...] = ()
    start: int | None = None
    stop: int | None = None
    step: int | None = None
    per_prompt: tuple["Positions", ...] = ()

    def __post_init__(self):
        """Every field checked here, not only in `of`: a `Positions(...)` built directly reaches the forward pass
        (and a vLLM worker) through the same ops, so it meets the same bounds."""
        kind = self.kind
        if kind not in _KINDS:
            raise SpecError(fix(f"positions kind {shown(kind)} is not one of {', '.join(_KINDS)}.",
                                'build positions from a value: positions="all", "last", 3, [0, 2] or slice(1, None).'))
        for name in ("indices", "per_prompt"):
            value = getattr(self, name)
            if not _is_list(value):
                raise SpecError(fix(f"Positions.{name}={shown(value)} is not a sequence.",
                                    'build positions from a value: positions=[0, 2].'))
            object.__setattr__(self, name, tuple(value))
        used = {"indices": bool(self.indices), "per_prompt": bool(self.per_prompt),
                "slice": any(p is not None for p in (self.start, self.stop, self.step))}
        extra = [name for name, on in used.items() if on and name != kind]
        if extra:
            raise SpecError(fix(f"Positions({kind!r}) also sets {', '.join(extra)}, which a {kind} selection "
                                "ignores.", "set only the fields of its kind, or build it with Positions.of(value)."))
        if kind == "indices":
            if not self.indices:
                raise SpecError(fix("positions=[] selects nothing.", 'use "all", "last" or at least one index.'))
            for i in self.indices:
                _position(i)
        elif kind == "slice":
            for p in (self.start, self.stop, self.step):
                if p is not None:
                    _position(p)
            if self.step is not None and self.step <= 0:
                raise SpecError(fix(f"positions slice step must be positive, got {self.step}.", "use slice(a, b, 1)."))
        elif kind == "per_prompt":
            if not all(isinstance(p, Positions) and p.kind != "per_prompt" for p in self.per_prompt):
                raise SpecError(fix(f"positions {shown(self.per_prompt)} is not one entry per prompt.",
                                    'give one entry per prompt, each "all", "last", an int, a list of ints or a '
                                    'slice.'))

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
            return cls("slice", start=value.start, stop=value.stop, step=value.step)
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, Sequence) and not isinstance(value, str):
            if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return cls("indices", indices=tuple(value))
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


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str)


def _position(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(fix(f"position {shown(value)} is not an int.", "positions are ints (or None in a slice)."))
    if not is_index(value):
        raise SpecError(fix(f"position {shown(value)} is past any prompt: positions lie within +-{MAX_INDEX}.",
                            "use an index within the prompt (negative counts from the end), or None in a slice "
                            "for \"to the end\"."))
    return value


ALL = Positions("all")
LAST = Positions("last")


def position_index(positions, lengths: tuple[int, ...], verb: str) -> Tensor:
    """[batch, n] indices into each prompt's own positions: `positions=` of logit_lens, steer and forward (not an
    op's `Positions`: one index list for every prompt, or "last"), checked against every prompt before the forward."""
    if positions == "last":
        return torch.tensor([[n - 1] for n in lengths])
    wanted = [positions] if isinstance(positions, int) else list(positions)
    if isinstance(positions, str) or not wanted or not all(isinstance(p, int) and not isinstance(p, bool)
                                                           for p in wanted):
        raise SpecError(fix(f"positions={positions!r} is not what {verb} keeps.",
                            'pass "last", an index, or a non-empty list of indices, e.g. positions=[-2, -1].'))
    bad = sorted({p for p in wanted for n in lengths if not -n <= p < n})
    if bad:
        raise SpecError(fix(f"positions {bad} fall outside a prompt of {min(lengths)} tokens.",
                            f"use indices in {-min(lengths)}..{min(lengths) - 1}, which every prompt has."))
    return torch.tensor([[p % n for p in wanted] for n in lengths])


def at_positions(values: Tensor, index: Tensor, *, dim: int) -> Tensor:
    """`values` (batch at dim - 1, pos at dim) at each prompt's `index` row: pos becomes the chosen positions."""
    shape = [1] * values.dim()
    shape[dim - 1], shape[dim] = index.shape
    expanded = list(values.shape)
    expanded[dim] = index.shape[1]
    return torch.gather(values, dim, index.to(values.device).view(shape).expand(expanded))
