"""Where an Arch's points sit in one loaded HF model: the modules of each decoder layer that hooks go on."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from interp_engine.arch import Arch, Dims
from interp_engine.weights import Weights


@dataclass(frozen=True, slots=True)
class Block:
    """The modules of one decoder layer that hooks go on."""

    layer: torch.nn.Module
    # None where the arch does not serve those points (validation refuses them first).
    attention: torch.nn.Module | None
    attn_out: torch.nn.Module | None
    mlp_down: torch.nn.Module | None  # None also: a sparse MLP (no mlp_act)
    mlp_out: torch.nn.Module | None
    mid_norm: torch.nn.Module | None  # None also: a parallel block, whose resid_mid is realised through attn_out
    router: "Router | None" = None
    mlp_pre: torch.nn.Module | None = None  # its output is mlp_pre (the first half of it: Arch.mlp_pre_half)
    mlp_up: torch.nn.Module | None = None  # its output is mlp_pre_linear (the second half: Arch.mlp_pre_half)
    mlp_pre_half: bool = False
    kv_latent: torch.nn.Module | None = None  # its output is kv_latent (multi-head latent attention)
    linear: torch.nn.Module | None = None  # a linear-attention layer's Gated DeltaNet (arch.linear_attention)
    lin_rep: int = 1  # value heads per key head there
    mlp_tail: bool = False  # Arch.mlp_tail: resid_mid is written through attn_out
    kv_shares: str | None = None  # Arch.kv_shares: the attention kwarg holding the keys later layers reuse
    o_proj: torch.nn.Module | None = None  # Arch.o_proj: W_O read from the layer itself (no TL-shaped weights)


@dataclass(frozen=True, slots=True)
class Router:
    """A sparse MLP's gate, and how the experts choose from its logits (to choose again after an edit)."""

    gate: torch.nn.Module
    routing: tuple  # route()'s arguments after the logits
    experts: torch.nn.Module  # forward(rows, top-k ids, top-k weights) -> the weighted sum


@dataclass(frozen=True, slots=True)
class Layout:
    """Where an Arch's points sit in one loaded model. Looked up once at load: walking the dotted module paths
    for every layer on every call cost more than installing the hooks themselves."""

    blocks: tuple[Block, ...]
    final_norm: torch.nn.Module
    # The model's TransformerLens-shaped weights, read when first asked (attn_result needs W_O).
    weights: "Callable[[], Weights] | None" = None

    @classmethod
    def of(cls, model: torch.nn.Module, arch: Arch, dims: Dims,
           weights: "Callable[[], Weights] | None" = None) -> "Layout":
        layers = model.get_submodule(arch.layers)

        def at(layer, path):
            return layer.get_submodule(path) if path is not None else None

        moe, config = arch.moe, model.config

        def block(i: int) -> Block:
            layer, kinds = layers[i], dims.layer_kinds[i] if dims.layer_kinds else ()
            # A dense layer of a mixture-of-experts model has no router; an MoE layer no dense MLP (Gemma 4's has).
            sparse = moe is not None and "dense" not in kinds
            dense = moe is None or "dense" in kinds or moe.dense_mlp
            gate = layer.get_submodule(moe.router) if sparse else None
            router = Router(gate, moe.routing(config, gate, layer), layer.get_submodule(moe.experts)) if sparse else None
            mlp = (lambda p: at(layer, p)) if dense else (lambda p: None)
            # A linear-attention layer has no softmax attention; its Gated DeltaNet's output is attn_out.
            linear = at(layer, arch.linear_attention) if "linear_attention" in kinds else None
            return Block(layer, None if linear else at(layer, arch.attention), linear or at(layer, arch.attn_out),
                         mlp(arch.mlp_down), at(layer, arch.mlp_out), at(layer, arch.mid_norm), router,
                         mlp(arch.mlp_pre), mlp(arch.mlp_up), arch.mlp_pre_half, at(layer, arch.kv_latent), linear,
                         dims.n_lin_v_heads // (dims.n_lin_k_heads or 1), arch.mlp_tail, arch.kv_shares,
                         at(layer, arch.o_proj))

        return cls(tuple(block(i) for i in range(dims.n_layers)), model.get_submodule(arch.final_norm), weights)
