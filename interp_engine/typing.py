"""The one axis vocabulary (its names: axes.py), as jaxtyping aliases.

Every tensor a public function returns is annotated with these names, and `func/shapes.py` checks each result
against them with the model's sizes bound (so `d_model` means this model's d_model, not "any size").

Axes: layer batch pos d_model n_heads n_kv_heads d_head d_head_v d_mlp d_vocab q_pos k_pos d_latent.
`layer` counts the rows of a stacked result (the logit lens' points); `q_pos`/`k_pos` are the query and key
positions of an attention pattern. Deliberately no `from __future__ import annotations`: jaxtyping and beartype
read these hints at run time.
"""

import functools

import torch
from jaxtyping import Float, Int, Int64, Shaped
from torch import Tensor

from interp_engine.axes import AXES, MODEL_AXES, Axis

Tokens = Int[Tensor, "batch pos"]
Resid = Float[Tensor, "batch pos d_model"]
Heads = Float[Tensor, "batch pos n_heads d_head"]
KVHeads = Float[Tensor, "batch pos n_kv_heads d_head"]
VHeads = Float[Tensor, "batch pos n_kv_heads d_head_v"]  # v (d_head_v: d_head but under latent attention)
ZHeads = Float[Tensor, "batch pos n_heads d_head_v"]
Pattern = Float[Tensor, "batch n_heads q_pos k_pos"]
MLPAct = Float[Tensor, "batch pos d_mlp"]
Logits = Float[Tensor, "batch pos d_vocab"]
LogProbs = Float[Tensor, "layer batch pos d_vocab"]
Scalar = Float[Tensor, ""]
FeatureActs = Float[Tensor, "batch pos _d_sae"]  # an SAE's width, not the model's: `_` leaves it unbound
TopFeatureActs = Float[Tensor, "batch pos _top_features"]
TopFeatureIds = Int64[Tensor, "batch pos _top_features"]
Vector = Float[Tensor, "..."]

_BY_AXES = {tuple(hint.dim_str.split()): hint for hint in (Resid, Heads, KVHeads, VHeads, ZHeads, Pattern,
                                                                   MLPAct, Logits)}
_MODEL = Shaped[Tensor, " ".join(MODEL_AXES)]


@functools.cache
def activation(axes: tuple[str, ...]) -> type:
    """The alias for a point's axes (`addresses.POINTS[...].axes`): `("batch", "pos", "d_model")` -> Resid."""
    unknown = [a for a in axes if a not in AXES]
    if unknown:
        raise ValueError(f"internal: axes {unknown} are not in the vocabulary {AXES}")
    return _BY_AXES.get(tuple(axes)) or Float[Tensor, " ".join(axes)]


@functools.lru_cache(maxsize=256)
def meta(shape: tuple[int, ...]) -> Tensor:
    """A storage-free tensor of `shape`, for binding sizes in a jaxtyping memo (made once per shape: creating one
    costs more than the check it feeds)."""
    return torch.empty(shape, device="meta")


def bind_model(dims) -> None:
    """Bind MODEL_AXES to `dims` (an arch.Dims) in the current jaxtyping memo (inside `jaxtyped("context")` or
    a jaxtyped function), so that later checks in that memo hold each result to this model's sizes.

    A meta tensor has a shape and no storage; one per shape is kept, so a check allocates nothing.
    """
    if not isinstance(meta(tuple(getattr(dims, a) for a in MODEL_AXES)), _MODEL):  # only fails if the memo already disagrees with the model
        raise ValueError(f"internal: the shape memo already holds sizes other than this model's {dims}")


__all__ = ["Axis", "AXES", "MODEL_AXES", "Tokens", "Resid", "Heads", "KVHeads", "VHeads", "ZHeads", "Pattern", "MLPAct",
           "Logits", "LogProbs", "Scalar", "FeatureActs", "TopFeatureActs", "TopFeatureIds", "Vector", "activation",
           "bind_model", "meta"]
