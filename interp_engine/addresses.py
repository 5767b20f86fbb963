"""Addresses name a point in a model: `Address("resid_post", 10)` is `resid_post.10`.

No torch import here: addresses are plain data that travel to workers and into JSON.
"""

import difflib
from dataclasses import dataclass
from typing import Literal

from interp_engine.errors import PointError, fix

Axis = Literal["batch", "pos", "d_model", "n_heads", "n_kv_heads", "d_head", "d_mlp", "d_vocab", "q_pos", "k_pos"]


@dataclass(frozen=True, slots=True)
class PointInfo:
    """One row of the point table: its axes, whether it has a layer, and who can write it."""

    name: str
    axes: tuple[Axis, ...]
    layered: bool = True
    eager_only_write: bool = False
    needs_eager_attention: bool = False

    @property
    def head_axis(self) -> int | None:
        for i, axis in enumerate(self.axes):
            if axis in ("n_heads", "n_kv_heads"):
                return i
        return None

    @property
    def pos_axis(self) -> int:
        return self.axes.index("q_pos") if "q_pos" in self.axes else self.axes.index("pos")


_RESID = ("batch", "pos", "d_model")
POINTS: dict[str, PointInfo] = {
    p.name: p
    for p in (
        PointInfo("embed", _RESID, layered=False),
        PointInfo("resid_pre", _RESID),
        PointInfo("q", ("batch", "pos", "n_heads", "d_head")),
        PointInfo("k", ("batch", "pos", "n_kv_heads", "d_head")),
        PointInfo("v", ("batch", "pos", "n_kv_heads", "d_head")),
        PointInfo("attn_scores", ("batch", "n_heads", "q_pos", "k_pos"), eager_only_write=True,
                  needs_eager_attention=True),
        PointInfo("attn_probs", ("batch", "n_heads", "q_pos", "k_pos"), eager_only_write=True,
                  needs_eager_attention=True),
        PointInfo("z", ("batch", "pos", "n_heads", "d_head")),
        PointInfo("attn_out", _RESID),
        PointInfo("resid_mid", _RESID),
        PointInfo("mlp_act", ("batch", "pos", "d_mlp")),
        PointInfo("mlp_out", _RESID),
        PointInfo("resid_post", _RESID),
        PointInfo("final", _RESID, layered=False),
        PointInfo("logits", ("batch", "pos", "d_vocab"), layered=False, eager_only_write=True),
    )
}


def _nearest(name: str) -> str:
    close = difflib.get_close_matches(name, list(POINTS), n=1, cutoff=0.0)
    return close[0] if close else "resid_post"


@dataclass(frozen=True, slots=True, order=True)
class Address:
    """A point and, for per-layer points, a layer (negative counts from the end)."""

    point: str
    layer: int | None = None

    def __post_init__(self):
        if not isinstance(self.point, str):
            raise PointError(fix(f"Address point must be a string, got {type(self.point).__name__}.",
                                 'write Address("resid_post", 10) or Address.parse("resid_post.10").'))
        info = POINTS.get(self.point)
        if info is None:
            near = _nearest(self.point)
            raise PointError(fix(f"{self.point!r} is not a point.",
                                 f"did you mean {near!r}? Valid points: {', '.join(POINTS)}."))
        if isinstance(self.layer, bool) or (self.layer is not None and not isinstance(self.layer, int)):
            raise PointError(fix(f"layer of {self.point} must be an int, got {self.layer!r}.",
                                 f'write Address("{self.point}", 3).'))
        if info.layered and self.layer is None:
            raise PointError(fix(f"{self.point} is a per-layer point and needs a layer.",
                                 f'write Address("{self.point}", 0) or Address("{self.point}", -1) for the last.'))
        if not info.layered and self.layer is not None:
            raise PointError(fix(f"{self.point} is a model-level point and takes no layer.",
                                 f'write Address("{self.point}").'))

    @classmethod
    def parse(cls, text: "str | Address") -> "Address":
        """`"resid_post.10"` -> `Address("resid_post", 10)`; `"logits"` -> `Address("logits")`."""
        if isinstance(text, Address):
            return text
        if not isinstance(text, str):
            raise PointError(fix(f"cannot read an address from {type(text).__name__} {text!r}.",
                                 'pass a string like "resid_post.10" or an Address.'))
        name, dot, layer = text.strip().rpartition(".")
        if not dot:
            return cls(text.strip())
        try:
            return cls(name, int(layer))
        except ValueError:
            raise PointError(fix(f"cannot read a layer from {text!r}.",
                                 'write "<point>.<layer>", e.g. "resid_post.10" or "resid_post.-1".')) from None

    @property
    def info(self) -> PointInfo:
        return POINTS[self.point]

    def resolve(self, n_layers: int, *, model_name: str = "this model") -> "Address":
        """Turn a negative layer into a positive one; refuse a layer the model does not have."""
        if self.layer is None:
            return self
        layer = self.layer + n_layers if self.layer < 0 else self.layer
        if not 0 <= layer < n_layers:
            raise PointError(fix(
                f"{self} does not exist in {model_name!r}: it has {n_layers} layers (0..{n_layers - 1}).",
                f"use {self.point}.{n_layers - 1}, or count from the end with Address({self.point!r}, -1).",
            ))
        return Address(self.point, layer)

    def __str__(self) -> str:
        return self.point if self.layer is None else f"{self.point}.{self.layer}"

    def __repr__(self) -> str:
        return f"Address({self.point!r})" if self.layer is None else f"Address({self.point!r}, {self.layer})"
