"""Addresses name a point in a model: `Address("resid_post", 10)` is `resid_post.10`.

No torch import here: addresses are plain data that travel to workers and into JSON. The axis names are axes.py's.
"""

import difflib
import functools
import re
from dataclasses import dataclass

from interp_engine.errors import PointError, fix
from interp_engine.axes import Axis


@dataclass(frozen=True, slots=True)
class PointInfo:
    """One row of the point table: its axes, whether it has a layer, and who can write it."""

    name: str
    axes: tuple[Axis, ...]
    layered: bool = True
    eager_only_write: bool = False
    needs_eager_attention: bool = False
    read_only: bool = False  # derived from another point, never written (write that one instead)
    eager_only_read: bool = False  # read (and, unless read_only, written) on eager only: vLLM never forms it

    @property
    def head_axis(self) -> int | None:
        for i, axis in enumerate(self.axes):
            if axis in ("n_heads", "n_kv_heads", "n_lin_k_heads", "n_lin_v_heads"):
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
        PointInfo("kv_latent", ("batch", "pos", "d_latent")),
        PointInfo("q", ("batch", "pos", "n_heads", "d_head")),
        PointInfo("k", ("batch", "pos", "n_kv_heads", "d_head")),
        PointInfo("v", ("batch", "pos", "n_kv_heads", "d_head_v")),
        PointInfo("attn_scores", ("batch", "n_heads", "q_pos", "k_pos"), eager_only_write=True,
                  needs_eager_attention=True),
        PointInfo("attn_probs", ("batch", "n_heads", "q_pos", "k_pos"), eager_only_write=True,
                  needs_eager_attention=True),
        PointInfo("z", ("batch", "pos", "n_heads", "d_head_v")),
        PointInfo("attn_result", ("batch", "pos", "n_heads", "d_model"), read_only=True),
        # A linear-attention (Gated DeltaNet) layer's own points (arch/qwen3_next.py says what each one is).
        PointInfo("lin_q", ("batch", "pos", "n_lin_k_heads", "d_lin_k"), eager_only_read=True),
        PointInfo("lin_k", ("batch", "pos", "n_lin_k_heads", "d_lin_k"), eager_only_read=True),
        PointInfo("lin_v", ("batch", "pos", "n_lin_v_heads", "d_lin_v"), eager_only_read=True),
        PointInfo("lin_beta", ("batch", "pos", "n_lin_v_heads")),
        PointInfo("lin_g", ("batch", "pos", "n_lin_v_heads")),
        PointInfo("lin_z", ("batch", "pos", "n_lin_v_heads", "d_lin_v")),
        PointInfo("lin_out", ("batch", "pos", "n_lin_v_heads", "d_lin_v")),
        PointInfo("attn_out", _RESID),
        PointInfo("resid_mid", _RESID),
        PointInfo("mlp_pre", ("batch", "pos", "d_mlp"), read_only=True),
        PointInfo("mlp_pre_linear", ("batch", "pos", "d_mlp"), read_only=True),
        PointInfo("mlp_act", ("batch", "pos", "d_mlp")),
        PointInfo("mlp_out", _RESID),
        PointInfo("router_logits", ("batch", "pos", "n_experts")),
        PointInfo("expert_weights", ("batch", "pos", "n_experts"), read_only=True),
        PointInfo("expert_out", ("batch", "pos", "top_k", "d_model"), read_only=True),
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
        # Bounded here so that no later message or tensor index meets an integer of hundreds of digits.
        if self.layer is not None and not -_MAX_LAYER <= self.layer <= _MAX_LAYER:
            raise PointError(fix(f"layer of {self.point} is an integer of {self.layer.bit_length()} bits; no model "
                                 f"has that many layers (the bound is +-{_MAX_LAYER}).",
                                 f'use a layer the model has, e.g. Address("{self.point}", -1) for the last.'))
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
        return _parsed(cls, text) if len(text) <= 64 else cls._read(text)

    @classmethod
    def _read(cls, text: str) -> "Address":
        if is_tl_name(text.strip()):
            return cls(*_from_tl(text.strip()))
        name, dot, layer = text.strip().rpartition(".")
        if not dot:
            return cls(text.strip())
        try:
            return cls(name, _layer(layer))
        except ValueError:
            raise PointError(fix(f"cannot read a layer from {text!r}.",
                                 'write "<point>.<layer>", e.g. "resid_post.10" or "resid_post.-1".')) from None

    @property
    def info(self) -> PointInfo:
        return POINTS[self.point]

    @property
    def tl_name(self) -> str | None:
        """TransformerLens's hook name for this point (`blocks.10.hook_resid_post`); None for `logits`, which TL
        returns from the forward rather than hooking."""
        suffix = _TL_OF_POINT.get(self.point)
        if suffix is None or self.layer is None:
            return suffix
        return f"blocks.{self.layer}.{suffix}"

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
        return self if layer == self.layer else Address(self.point, layer)

    def __str__(self) -> str:
        return self.point if self.layer is None else f"{self.point}.{self.layer}"

    def __repr__(self) -> str:
        return f"Address({self.point!r})" if self.layer is None else f"Address({self.point!r}, {self.layer})"


# ------------------------------------------------------------------------------------- TransformerLens names
# TL hook name -> our point. Per-layer names live under `blocks.L.`. Where TL has two names for what we hold
# as one point, the first listed is the spelling `tl_name` gives back.
_TL_PER_LAYER: dict[str, str] = {
    "hook_resid_pre": "resid_pre",
    # Ours are after rotary (what attention sees): exactly TL's hook_rot_q/hook_rot_k on rotary models, and
    # TL's hook_q/hook_k on models without rotary (GPT-2). TL's pre-rotary q/k have no counterpart here.
    "attn.hook_q": "q", "attn.hook_rot_q": "q",
    "attn.hook_k": "k", "attn.hook_rot_k": "k",
    "attn.hook_v": "v",
    "attn.hook_z": "z",
    "attn.hook_result": "attn_result",  # both: before Gemma-2/3's and OLMo 2's post-attention norm
    "attn.hook_attn_scores": "attn_scores",  # both: pre-softmax, scaled, masked keys -inf
    "attn.hook_pattern": "attn_probs",
    "hook_attn_out": "attn_out",
    "hook_resid_mid": "resid_mid",
    "mlp.hook_pre": "mlp_pre",  # the gate's output on a gated MLP, as TL's
    "mlp.hook_pre_linear": "mlp_pre_linear",  # the up projection's output
    "mlp.hook_post": "mlp_act",  # input of the down projection (TL: after act, times the gate's up half)
    "hook_mlp_out": "mlp_out",
    "mlp.hook_gate": "router_logits",  # TL's MoE: the gate's logits, before the softmax and top-k
    "hook_resid_post": "resid_post",
}
_TL_MODEL: dict[str, str] = {
    "hook_embed": "embed",  # ours includes learned positions (GPT-2): TL's hook_embed + hook_pos_embed there
    "ln_final.hook_normalized": "final",
}
# TL names with no equivalent, each with the nearest point and what the TL hook holds instead.
_TL_NEAREST_PER_LAYER: dict[str, tuple[str, str]] = {
    "ln1.hook_scale": ("resid_pre", "a LayerNorm scale factor"),
    "ln1.hook_normalized": ("resid_pre", "the normalised input of attention"),
    "hook_attn_in": ("resid_pre", "a per-head copy of the attention input"),
    "hook_q_input": ("resid_pre", "a per-head copy of the query input"),
    "hook_k_input": ("resid_pre", "a per-head copy of the key input"),
    "hook_v_input": ("resid_pre", "a per-head copy of the value input"),
    "ln1_post.hook_normalized": ("attn_out", "Gemma-2's post-attention norm output (our attn_out there)"),
    "ln2.hook_scale": ("resid_mid", "a LayerNorm scale factor"),
    "ln2.hook_normalized": ("resid_mid", "the normalised input of the MLP"),
    "hook_mlp_in": ("resid_mid", "a copy of the MLP input"),
    "mlp.hook_expert_weights": ("expert_weights", "the k chosen experts' weights (ours: every expert's, zero where "
                                "not chosen)"),
    "mlp.hook_expert_indices": ("expert_weights", "the k chosen experts' indices (ours: nonzero where chosen)"),
    "ln2_post.hook_normalized": ("mlp_out", "Gemma-2's post-MLP norm output (our mlp_out there)"),
}
_TL_NEAREST_MODEL: dict[str, tuple[str, str]] = {
    "hook_pos_embed": ("embed", "learned positional embeddings alone"),
    "ln_final.hook_scale": ("final", "a LayerNorm scale factor"),
}
_TL_OF_POINT: dict[str, str] = {
    **{point: name for name, point in reversed(list(_TL_PER_LAYER.items()))},
    **{point: name for name, point in _TL_MODEL.items()},
}
_TL_BLOCK = re.compile(r"blocks\.(-?\d+)\.(.+)")


_MAX_LAYER = 2**31 - 1


def _layer(digits: str) -> int:
    """int(digits), refusing a number of more than 12 digits before Python parses it (it refuses 4300 and more
    with a raw ValueError)."""
    if len(digits.strip().lstrip("+-")) > 12:
        raise PointError(fix(f"layer {digits[:20]}... has {len(digits)} digits; no model has that many layers.",
                             'use a layer the model has, e.g. "resid_post.-1" for the last.'))
    return int(digits)


def is_tl_name(text: str) -> bool:
    """True for TransformerLens spellings: `blocks.L.hook_...`, `hook_...`, `ln_final.hook_...`."""
    return text.startswith(("blocks.", "hook_", "ln_final."))


def _from_tl(text: str) -> tuple[str, int | None]:
    block = _TL_BLOCK.fullmatch(text)
    layer, name = (_layer(block[1]), block[2]) if block else (None, text)
    table, nearest = (_TL_PER_LAYER, _TL_NEAREST_PER_LAYER) if block else (_TL_MODEL, _TL_NEAREST_MODEL)
    if name in table:
        return table[name], layer
    if name in nearest:
        point, what = nearest[name]
        address = Address(point, layer)
        raise PointError(fix(f"{text!r} is a TransformerLens hook with no equivalent here: it holds {what}.",
                             f"the nearest point is {address} (TL's {address.tl_name}); capture it and derive "
                             "the rest."))
    loose = re.match(r"blocks\.(-?\d+)", text)  # keep the user's layer in the suggestion
    at = int(loose[1]) if loose else 0
    near = difflib.get_close_matches(text, [*(f"blocks.{at}.{n}" for n in _TL_PER_LAYER), *_TL_MODEL],
                                     n=1, cutoff=0.0)[0]
    raise PointError(fix(f"{text!r} is not a TransformerLens hook name that maps to a point here.",
                         f"did you mean {near!r} ({Address.parse(near)})? Our points: {', '.join(POINTS)}."))


@functools.lru_cache(maxsize=4096)
def _parsed(cls, text: str) -> "Address":
    """Addresses are immutable, and tables name the same few points call after call (a vLLM worker reads each
    table's): read each text once."""
    return cls._read(text)
