"""Applying ops to one activation tensor, restricted to the positions a `Step` selects. Shared by every
backend: eager hooks see `batch pos ...`, vLLM workers view their flattened rows as one `1 rows ...` batch.

Tensors arrive in the point's presented layout: `batch pos ...` or, for attention patterns,
`batch n_heads q_pos k_pos`. Every edit is out of place, so autograd and torch.func see plain tensor ops.
"""

from dataclasses import dataclass

import torch
from einops import rearrange
from torch import Tensor

from interp_engine.addresses import PointInfo
from interp_engine.errors import SpecError, fix
from interp_engine.sae import flat
from interp_engine.spec import Ablate, Add, Clamp, Custom, Patch, Positions, Scale, Set, Splice


@dataclass(frozen=True, slots=True)
class Step:
    """Where one forward pass's columns sit in their prompts. Every field is [b, pos] (or broadcasts to it), so
    one row may hold columns of several prompts, as a vLLM step does."""

    abs_pos: Tensor  # position of each column in its prompt's sequence, -1 for padding
    last: Tensor  # the position "last" means (last prompt token; the newest token while generating)
    lengths: Tensor  # prompt lengths; negative indices count back from here
    prompt_index: Tensor  # index of the column's prompt in the whole call (for per-prompt data)
    kv_in_place: bool = False  # generating: k/v edits are also written into the KV cache

    @classmethod
    def of_rows(cls, abs_pos: Tensor, *, last: Tensor, lengths: Tensor, prompt_index: Tensor,
                kv_in_place: bool = False) -> "Step":
        """From per-row [b] values, as the eager backend lays a batch out."""
        return cls(abs_pos, last[:, None], lengths[:, None], prompt_index[:, None], kv_in_place)

    @property
    def valid(self) -> Tensor:
        return self.abs_pos >= 0

    def column(self, field: Tensor) -> Tensor:
        return field.expand_as(self.abs_pos)


def select(positions: Positions, step: Step) -> Tensor | None:
    """Boolean [b, pos] of the columns `positions` picks, or None for every column."""
    ap = step.abs_pos
    kind = positions.kind
    if kind == "all":
        return None
    n = step.column(step.lengths).to(ap.device)
    if kind == "last":
        return ap == step.column(step.last).to(ap.device)
    if kind == "indices":
        idx = torch.tensor(positions.indices, dtype=torch.long, device=ap.device)
        wanted = torch.where(idx < 0, n[..., None] + idx, idx)
        return (ap[..., None] == wanted).any(-1) & (ap >= 0)
    if kind == "slice":
        start = torch.full_like(n, positions.start or 0)
        start = torch.where(start < 0, start + n, start).clamp_min(0)
        stop = torch.full_like(n, 2**62) if positions.stop is None else torch.full_like(n, positions.stop)
        stop = torch.where(stop < 0, stop + n, stop)
        every = positions.step or 1
        return (ap >= start) & (ap < stop) & ((ap - start) % every == 0)
    prompt = step.column(step.prompt_index).to(ap.device)
    picked = torch.zeros_like(ap, dtype=torch.bool)
    for index in prompt[ap >= 0].unique().tolist():
        sub = select(positions.per_prompt[index], step)
        mine = prompt == index
        picked |= mine & (ap >= 0) if sub is None else mine & sub
    return picked


def _expand_mask(mask: Tensor, x: Tensor, info: PointInfo) -> Tensor:
    """[b, pos] -> broadcastable against x."""
    if info.pos_axis == 2:
        return mask[:, None, :, None]
    return mask.reshape(*mask.shape, *([1] * (x.ndim - 2)))


def _value(t: Tensor, x: Tensor, info: PointInfo, step: Step) -> tuple[Tensor, Tensor | None]:
    """A per-position value broadcast against x, or a whole-point value gathered by (prompt, position)."""
    t = t.to(device=x.device, dtype=x.dtype)
    pa = info.pos_axis
    feat = tuple(s for i, s in enumerate(x.shape) if i not in (0, pa))
    if t.ndim != x.ndim:  # one position's worth: broadcast over batch and positions
        shape = [1] * x.ndim
        for i, s in zip([i for i in range(x.ndim) if i not in (0, pa)], feat):
            shape[i] = s
        return t.reshape(shape), None
    ap = step.abs_pos.to(x.device)
    rows = step.column(step.prompt_index).to(x.device)
    if t.shape[0] == 1:
        rows = torch.zeros_like(rows)
    width = t.shape[pa]
    in_range = (ap >= 0) & (ap < width)
    cols = ap.clamp(0, width - 1)
    if pa == 1:
        return t[rows, cols], in_range
    g = t[rows, :, cols]  # advanced indexing puts the indexed axes first
    return rearrange(g, "batch q_pos n_heads k_pos -> batch n_heads q_pos k_pos")[..., : x.shape[-1]], in_range


def _head_mask(heads: tuple[int, ...], x: Tensor, info: PointInfo) -> Tensor:
    axis = 1 if info.pos_axis == 2 else info.head_axis
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    m = torch.zeros(x.shape[axis], dtype=torch.bool, device=x.device)
    m[list(heads)] = True
    return m.reshape(shape)


def _mean(x: Tensor, info: PointInfo, step: Step) -> Tensor:
    valid = _expand_mask(step.valid.to(x.device), x, info).to(x.dtype)
    dims = (0, info.pos_axis)
    return (x * valid).sum(dims, keepdim=True) / valid.sum(dims, keepdim=True).clamp_min(1)


def apply(op, x: Tensor, info: PointInfo, step: Step) -> Tensor:
    """The activation after `op`, changed only where `op.positions` selects."""
    mask = select(op.positions, step)
    if isinstance(op, Add):
        v, in_range = _value(op.vector.tensor, x, info, step)
        new = x + op.scale * v
    elif isinstance(op, Set | Patch):
        v, in_range = _value((op.value if isinstance(op, Set) else op.source).tensor, x, info, step)
        new = v.expand_as(x)
    elif isinstance(op, Scale):
        in_range = None
        new = x * op.factor if op.heads is None else torch.where(_head_mask(op.heads, x, info), x * op.factor, x)
    elif isinstance(op, Ablate):
        in_range = None
        fill = torch.zeros_like(x) if op.how == "zero" else _mean(x, info, step).expand_as(x)
        new = fill if op.heads is None else torch.where(_head_mask(op.heads, x, info), fill, x)
    elif isinstance(op, Clamp | Splice):
        in_range = None
        feats = flat(x)
        new = (op.sae.clamped(feats, op.features, op.to) if isinstance(op, Clamp)
               else op.sae.spliced(feats, op.error)).reshape(x.shape)
    elif isinstance(op, Custom):
        in_range = None
        new = op.fn(x)
        if not isinstance(new, Tensor) or new.shape != x.shape:
            got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
            raise SpecError(fix(f"Custom fn at {op.point} returned {got}; expected shape {tuple(x.shape)}.",
                                "return a tensor shaped like its input."))
        new = new.to(x.dtype)
    else:  # pragma: no cover - Spec refuses other types
        raise SpecError(f"unknown op {op!r}")
    if in_range is not None:
        mask = in_range if mask is None else mask & in_range
    if mask is None:
        return new
    return torch.where(_expand_mask(mask, x, info), new, x)


def shift_addend(pre: Tensor, a: Tensor, r: Tensor, edited: Tensor) -> Tensor:
    """What the addend `a` must become for `pre + a` to be `edited` (r = pre + a, unedited): a sum edited where no
    module sees it (a parallel block's resid_mid, written through attn_out; Gemma 4's). Shifting a by (edited - r)
    keeps a small edit exact (a zero one bit for bit); edited - pre a large one (a zeroed stream exactly 0, which
    a norm would otherwise scale up from rounding): each element takes the one whose sum with pre is exact."""
    shifted = a + (edited - r)
    return torch.where(pre + shifted == edited, shifted, edited - pre)


def failure(ops, error: Exception) -> SpecError:
    """The library's error for an op (or the ops at one point, compiled together) raising while it ran, which
    the checks before the forward pass should have caught; for Custom, the caller's function raising."""
    ops = tuple(ops) if isinstance(ops, tuple | list) else (ops,)
    text = str(error).strip()
    what = f"{type(error).__name__}: {text if len(text) <= 300 else text[:297] + '...'}"
    if len(ops) == 1 and isinstance(ops[0], Custom):
        return SpecError(fix(f"Custom fn at {ops[0].point} raised {what}", "fix the function: it takes one "
                             "activation tensor and returns one of the same shape."))
    named = f"{type(ops[0]).__name__} at {ops[0].point}" if len(ops) == 1 else f"the ops at {ops[0].point}"
    return SpecError(fix(f"{named} failed while the forward pass ran ({what}); the checks before it let this through, "
                         "so nothing of the call was returned.",
                         "change the op (its values, positions or heads); the spec passed validation, so please also "
                         "report it (Spec.to_dict()) as an interp_engine bug."))


def affine(ops, like: Tensor, info: PointInfo, step: Step) -> tuple[Tensor, Tensor]:
    """`(mul, add)` such that applying `ops` in order to x gives `x * mul + add`, for ops that act on each element
    alone (every op but mean ablation and Custom). For a compiled graph, which cannot branch on a request: one op
    leaves x exactly as `apply` would (x * 1 == x, 0 + v == v); several compose to within rounding."""
    mul, add = torch.ones_like(like), torch.zeros_like(like)
    for op in ops:
        mask = select(op.positions, step)
        in_range = None
        if isinstance(op, Add):
            v, in_range = _value(op.vector.tensor, like, info, step)
            new_mul, new_add = mul, add + op.scale * v
        elif isinstance(op, Set | Patch):
            v, in_range = _value((op.value if isinstance(op, Set) else op.source).tensor, like, info, step)
            new_mul, new_add = torch.zeros_like(mul), v.expand_as(add)
        elif isinstance(op, Scale | Ablate) and not (isinstance(op, Ablate) and op.how != "zero"):
            factor = op.factor if isinstance(op, Scale) else 0.0
            m = torch.full_like(like, factor) if op.heads is None else \
                torch.where(_head_mask(op.heads, like, info), factor, 1.0).to(like.dtype).expand_as(like)
            new_mul, new_add = mul * m, add * m
        else:
            raise SpecError(fix(f"{type(op).__name__} at {op.point} cannot be compiled into a static tap.",
                                'use Add/Set/Scale/Ablate(how="zero")/Patch, or backend="eager".'))
        if in_range is not None:
            mask = in_range if mask is None else mask & in_range
        if mask is None:
            mul, add = new_mul, new_add
        else:
            keep = _expand_mask(mask, like, info)
            mul, add = torch.where(keep, new_mul, mul), torch.where(keep, new_add, add)
    return mul, add
