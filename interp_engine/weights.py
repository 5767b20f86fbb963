"""Weights in TransformerLens's names and shapes (`model.weights`, `model.W_U`, ...), and the norms as functions.

Shapes: W_E [d_vocab, d_model], W_pos [n_ctx, d_model], W_U [d_model, d_vocab], b_U [d_vocab]; per layer
W_Q [n_heads, d_model, d_head], W_K/W_V [n_kv_heads, d_model, d_head] (grouped-query checkpoints keep their
n_kv_heads: repeat them to n_heads if you need TL's expanded view), W_O [n_heads, d_head, d_model],
W_in/W_gate [d_model, d_mlp], W_out [d_mlp, d_model]. A bias the checkpoint lacks is zeros, as in TL. Not folded:
norm weights are their own tensors (Gemma's effective scale 1 + weight), nothing centred or rescaled.

Read-only by contract: on eager they are views of the live parameters, so writing into one changes the model;
on vLLM they are a copy fetched from the workers once per engine (backends/vllm/weights.py), shared by every
read of `model.weights`.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from interp_engine.arch import Arch
from interp_engine.errors import BackendError, PointError, fix


def check_served(arch: Arch) -> None:
    """TransformerLens's per-layer weights have no single meaning for an MoE model, and a discovered model has
    no table of where its projections are: refused on every backend, before any weight is read."""
    if arch.moe is not None or arch.discovered or arch.weights_refusal:
        what = ("a mixture-of-experts model, whose MLP is per expert" if arch.moe is not None else
                arch.weights_refusal or "a model without a family table (its layers were found from its structure)")
        raise BackendError(fix(f"TransformerLens-shaped weights are not served for {arch.family}: it is {what}.",
                               "read the HF parameters themselves: model.runtime.model.named_parameters() on "
                               'backend="eager".'))


@dataclass(frozen=True, slots=True)
class Norm:
    """A norm as the model applies it: kind "rmsnorm" or "layernorm"; `w` the effective scale (Gemma's 1 +
    weight), `b` the bias (zeros for RMSNorm)."""

    kind: str
    w: Tensor
    b: Tensor
    eps: float

    def scale(self, x: Tensor) -> Tensor:
        """The denominator the norm divides `x` by, [..., 1] (TransformerLens's hook_scale)."""
        x = x.float()
        if self.kind == "layernorm":
            x = x - x.mean(-1, keepdim=True)
        return (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()

    def linear(self, x: Tensor, scale: Tensor) -> Tensor:
        """The norm with its denominator fixed to `scale` and without the bias: linear in `x`, so it can be
        applied to each component of a residual stream separately and the parts sum to the whole minus `b`."""
        x = x.float()
        if self.kind == "layernorm":
            x = x - x.mean(-1, keepdim=True)
        return x / scale * self.w.float()

    def __call__(self, x: Tensor) -> Tensor:
        return (self.linear(x, self.scale(x)) + self.b.float()).to(x.dtype)


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """One decoder layer. ln1 feeds attention, ln2 the MLP (None: no such norm: OLMo 2 has none before either;
    Phi's one norm feeds both, and is ln1); ln1_post/ln2_post are the norms after attention and after the MLP
    (Gemma-2/3, OLMo 2)."""

    W_Q: Tensor
    W_K: Tensor
    W_V: Tensor
    W_O: Tensor
    b_Q: Tensor
    b_K: Tensor
    b_V: Tensor
    b_O: Tensor
    W_in: Tensor
    W_gate: Tensor | None  # None: not a gated MLP
    W_out: Tensor
    b_in: Tensor
    b_out: Tensor
    ln1: Norm | None
    ln2: Norm | None
    ln1_post: Norm | None = None
    ln2_post: Norm | None = None


STACKED = ("W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_in", "W_gate", "W_out", "b_in", "b_out")


@dataclass(frozen=True, slots=True)
class Weights:
    W_E: Tensor
    W_pos: Tensor | None  # None: positions are rotary, no table
    W_U: Tensor
    b_U: Tensor
    ln_final: Norm
    layers: tuple[LayerWeights, ...]

    def layer(self, index: int) -> LayerWeights:
        """Layer `index`'s weights (negative counts from the end)."""
        n = len(self.layers)
        if isinstance(index, bool) or not isinstance(index, int) or not -n <= index < n:
            raise PointError(fix(f"layer {index!r} does not exist: this model has {n} layers (0..{n - 1}).",
                                 f"use a layer in 0..{n - 1}, or count from the end: layer(-1)."))
        return self.layers[index]

    def stacked(self, name: str) -> Tensor:
        """One weight of every layer stacked, [n_layers, ...] (TransformerLens's `model.W_Q` and the like)."""
        if name not in STACKED:
            raise PointError(fix(f"{name!r} is not a per-layer weight.", f"use one of {', '.join(STACKED)}."))
        parts = [getattr(layer, name) for layer in self.layers]
        if any(p is None for p in parts):
            raise PointError(fix(f"this model has no {name} (its MLP is not gated).", "use W_in and W_out."))
        return torch.stack(parts)
