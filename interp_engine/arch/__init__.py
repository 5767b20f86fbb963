"""Architectures as data: where each point lives in a HuggingFace model.

One file per family holds an `Arch`; the registry maps `config.model_type` to it. Module paths are relative to
the causal-LM model (`layers`, `final_norm`, `unembed`) or to one decoder layer (the rest).
"""

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from interp_engine.arch.layers import LINEAR_POINTS, config_value
from interp_engine.arch.routing import Moe
from interp_engine.errors import LoadError, fix


@dataclass(frozen=True, slots=True)
class VllmLayout:
    """Where the points live in vLLM's implementation of a family (paths relative to vLLM's model)."""

    layers: str  # decoder layers: forward(positions, hidden, residual) -> (hidden, residual)
    final_norm: str  # norm(hidden, residual) -> (normed, resid_post of the last layer)
    # Relative to a layer; None where the family does not serve those points (a discovered model).
    attention: str | None = None  # the Attention module: forward(q, k, v) after rotary
    o_proj: str | None = None  # its input is z
    attn_out: str | None = None  # its output is attn_out
    mlp_out: str | None = None  # its output is mlp_out
    mlp_down: str | None = None  # its input is mlp_act
    mid_norm: str | None = None  # the fused add-norm called as (attn_out, resid_pre) ("first": as (resid_mid,))
    mlp_in: str | None = None  # the merged gate_up projection, whose output's halves are mlp_pre and mlp_pre_linear
    mlp_pre: str | None = None  # an ungated MLP's input projection (GPT-2's c_fc), whose output is mlp_pre
    # What a layer's output holds: "sum", the stream as (hidden, residual) that the next fused add-norm adds;
    # "first", the stream itself, alone or first of a tuple whose rest the next layer never reads; "batched", HF's
    # layers run by vLLM's Transformers backend: the stream alone, every tensor but q/k/v [1, tokens, ...].
    stream_out: str = "sum"
    router: str | None = None  # the MoE gate, whose output's first element is router_logits
    # The norm the experts' input is made by from the router's input, where they differ (Gemma 4: the router
    # normalises resid_mid itself, the experts read pre_feedforward_layernorm_2's); expert_out recomputes it.
    experts_norm: str | None = None
    kv_latent: str | None = None  # latent attention's KV norm, whose output is kv_latent
    # Attention and MLP both read resid_pre (GPT-NeoX, Phi): no module sees resid_mid, which is formed at attn_out's
    # output from the layer's input and written through attn_out, as on eager (sites.parallel_mid).
    parallel: bool = False
    # Points served there for reading only, and why (the refusal of a write says it).
    read_only: tuple[str, ...] = ()
    read_only_why: str = ""
    mla: str | None = None  # latent attention's MLAAttention: forward(q, latent, k_pe) after rotary (sites.LATENT_QKV)
    z_out: str | None = None  # a module whose output is z (gated attention: o_proj reads z * sigmoid(gate))
    # Hybrid linear attention: at a layer that has it instead of `attn_out`, the Gated DeltaNet (its output is
    # attn_out there), and its gated norm, called as norm(lin_out, lin_z).
    linear_attn: str | None = None
    lin_norm: str | None = None


@dataclass(frozen=True, slots=True)
class Arch:
    family: str
    model_types: tuple[str, ...]
    layers: str  # the ModuleList of decoder layers
    final_norm: str
    unembed: str
    # Inside a layer; None where the family does not serve those points (a discovered model).
    attention: str | None = None  # the attention module, whose kwargs reach the attention function
    attn_out: str | None = None  # module whose output is what attention adds to the residual stream
    mlp_out: str | None = None  # module whose output is what the MLP adds to the residual stream
    mlp_down: str | None = None  # module whose input is mlp_act (None: a sparse MLP, see `moe`)
    # Module whose output is mlp_pre (the gate's, for a gated MLP); None: no mlp_pre (a sparse MLP).
    mlp_pre: str | None = None
    mlp_up: str | None = None  # a gated MLP's up projection, whose output is mlp_pre_linear; None: not gated
    # A fused gate_up projection (both fields name it): mlp_pre is its output's first half, mlp_pre_linear the second.
    mlp_pre_half: bool = False
    parallel: bool = False  # attention and MLP both read resid_pre (GPT-NeoX, Phi)
    mid_norm: str | None = None  # sequential blocks: the norm whose input is resid_mid (the MLP's input norm)
    d_mlp_keys: tuple[str, ...] = ("intermediate_size",)
    vllm: VllmLayout | None = None  # None: the vLLM backends do not serve this family yet
    vllm_refusal: str | None = None  # why not, where it is known (said in the refusal)
    normalization: str = "rmsnorm"  # every norm's kind: "rmsnorm", "layernorm", or "gemma_rmsnorm" (scale 1 + w)
    positional: str = "rotary"  # "rotary" or "learned" (a position table added to the embedding)
    points: tuple[str, ...] | None = None  # the points served; None: every point (a table's family)
    moe: Moe | None = None  # a mixture-of-experts family: router_logits instead of mlp_act
    sdpa: bool = True  # HF's implementation has an SDPA path (GPT-OSS's has none: eager attention is the default)
    # The config keys of q's and k's head width (d_head), and of v's and z's (d_head_v; none: the same width).
    d_head_keys: tuple[str, ...] = ("head_dim",)
    d_head_v_keys: tuple[str, ...] = ()
    # Multi-head latent attention: the module whose output is the compressed KV latent (kv_latent), and the
    # config key of its width.
    kv_latent: str | None = None
    d_latent_key: str | None = None
    # Hybrid linear attention (Qwen3-Next, Qwen3.5): the token mixer of a config's "linear_attention" layers (a
    # Gated DeltaNet, whose output is attn_out there); the other layers' attention is `attention`.
    linear_attention: str | None = None
    output_gate: bool = False  # full attention multiplies z by a per-head sigmoid gate before o_proj
    # Gemma 4 (arch/gemma4.py): the config keys of how many last layers reuse earlier keys and values (kind
    # "kv_shared") and of their double-wide MLP; the attention kwarg holding the reused pair (edits are stored there);
    # mlp_tail: the block does more after the MLP's residual add (a resid_mid write goes through attn_out).
    kv_shared_key: str | None = None
    kv_shares: str | None = None
    double_wide_key: str | None = None
    mlp_tail: bool = False
    weights_refusal: str | None = None  # why TransformerLens-shaped weights are not served
    o_proj: str | None = None  # there: attention's output projection (a layer's own W_O, for attn_result)

    @property
    def discovered(self) -> bool:
        """Found from the model's structure (arch/discover.py), not a table: vLLM's modules are found in the
        worker the same way."""
        return self.family.startswith("discovered:")

    def serves(self, point: str) -> bool:
        return self.points is None or point in self.points

    def lacks(self, point: str) -> str | None:
        """Why this family has no `point` (a fix naming where to look instead), or None when it has it."""
        if point in MOE_POINTS and self.moe is None:
            return fix(f"{point} exists only in mixture-of-experts models; this is a dense {self.family} model.",
                       f"use a model of a family with experts ({', '.join(moe_families())}); on a dense model "
                       "mlp_act and mlp_out are the MLP's points.")
        if point in LINEAR_POINTS and self.linear_attention is None:
            return fix(f"{point} exists only in hybrid linear-attention models (Gated DeltaNet layers); every "
                       f"{self.family} layer is softmax attention.",
                       "read q, k, v and z (softmax attention's points), or use a model of a family with linear "
                       f"attention ({', '.join(linear_families())}).")
        if point == "kv_latent" and self.kv_latent is None:
            return fix(f"kv_latent is the compressed key-value latent of multi-head latent attention; {self.family} "
                       "computes each head's k and v directly.", "read k and v (each head's keys and values).")
        if point == "mlp_act" and self.moe is not None and self.mlp_down is None:
            return fix(f"mlp_act has no single meaning in a {self.family} model: each token's MLP is a weighted sum "
                       "of its chosen experts, each with its own hidden layer.",
                       "read router_logits or expert_weights (the router's choice) or mlp_out (what the experts add "
                       "to the residual stream together).")
        if point == "mlp_pre" and self.mlp_pre is None:
            if self.moe is not None:
                return fix(f"mlp_pre has no single meaning in a {self.family} model: each chosen expert has its own "
                           "hidden layer.", "read router_logits or expert_out (each chosen expert's output) or "
                           "mlp_out (what the experts add to the residual stream together).")
            return fix(f"the {self.family} table does not say where its MLP's input projection is.",
                       "read mlp_act (the down projection's input) or mlp_out.")
        if point == "mlp_pre_linear" and self.mlp_up is None:
            return fix(f"mlp_pre_linear is the up projection of a gated MLP; {self.family}'s MLP "
                       + ("is a mixture of experts." if self.moe is not None else
                          "has one input projection, whose output is mlp_pre."),
                       "read mlp_pre (the pre-activation) or mlp_act (after the activation).")
        if point == "attn_result" and self.output_gate:
            return fix(f"attn_result is not served for {self.family}: its attention multiplies z by a per-head "
                       "sigmoid output gate (the second half of q_proj's output) before o_proj.",
                       "read attn_out (what attention adds to the residual stream), or z and the gate: "
                       "self_attn.q_proj's output viewed as [n_heads, 2 * d_head], each head's second half.")
        if point == "attn_result" and (self.moe is not None or self.kv_latent is not None) and self.o_proj is None:
            return fix(f"attn_result is not served for {self.family}: it is computed from TransformerLens-shaped "
                       "W_O, which is not read for mixture-of-experts or latent-attention models.",
                       "read z and multiply by each head's slice of self_attn.o_proj.weight (its columns "
                       "h*d:(h+1)*d, d the width of z's heads).")
        return None


MOE_POINTS = ("router_logits", "expert_weights", "expert_out")


@dataclass(frozen=True, slots=True)
class Dims:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    max_len: int
    n_experts: int = 0  # routed experts per layer; 0: a dense model
    top_k: int = 0  # experts each token is routed to; 0: a dense model
    d_head_v: int = 0  # v's and z's head width; 0 when built: d_head (every family but latent attention)
    d_latent: int = 0  # kv_latent's width (MLA's kv_lora_rank); 0: no latent
    # Per layer, the kinds it is (arch/layers.py: which points each kind lacks); (): every layer has every point.
    layer_kinds: tuple[tuple[str, ...], ...] = ()
    # Linear-attention heads (axes.py): q/k heads and width, v/gate/output heads and width; 0: no such layers.
    n_lin_k_heads: int = 0
    n_lin_v_heads: int = 0
    d_lin_k: int = 0
    d_lin_v: int = 0
    # Per layer, the sizes in which it differs from the above, as (name, size) pairs (Gemma 4: a global layer's
    # d_head and n_kv_heads, a KV-shared layer's double-wide d_mlp); (): every layer has the model's sizes.
    layer_sizes: tuple[tuple[tuple[str, int], ...], ...] = ()

    def __post_init__(self):
        if not self.d_head_v:
            object.__setattr__(self, "d_head_v", self.d_head)
        # From JSON (the validator's saved dims) the kinds and sizes come back as lists.
        object.__setattr__(self, "layer_kinds", tuple(tuple(k) for k in self.layer_kinds))
        object.__setattr__(self, "layer_sizes", tuple(tuple((n, s) for n, s in ls) for ls in self.layer_sizes))

    def at(self, layer: int | None) -> "Dims":
        """The sizes of layer `layer` (resolved): this model's, with that layer's own where it differs."""
        own = self.layer_sizes[layer] if self.layer_sizes and layer is not None else ()
        if not own:
            return self
        sizes = dict(own)
        if "d_head" in sizes and "d_head_v" not in sizes and self.d_head_v == self.d_head:
            sizes["d_head_v"] = sizes["d_head"]
        return replace(self, layer_sizes=(), **sizes)


# The sizes read_dims takes from config.json, each a whole number of at least 1 when present (the first four
# must be): zero or negative sizes would price as "fits" or divide by zero, and build no model.
_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "num_key_value_heads",
          "head_dim", "max_position_embeddings", "n_positions")


# The same sizes under GPT-2's names, as config.json spells them (the config classes alias them).
_RAW_SIZES = (*_SIZES, "intermediate_size", "n_layer", "n_embd", "n_head", "n_inner")


def check_sizes(config, arch: Arch | None = None) -> None:
    """A transformers config (with its arch: the four required sizes must be there), or config.json as a dict
    before transformers reads it (whose own checks divide by num_attention_heads): numbers present must be >= 1."""
    raw = isinstance(config, Mapping)
    for key in _RAW_SIZES if raw else (*_SIZES, *arch.d_mlp_keys):
        value = config.get(key) if raw else config_value(config, key)
        if value is None and (raw or key not in _SIZES[:4]):
            continue
        if raw and (isinstance(value, bool) or not isinstance(value, int | float)):
            continue  # a wrong type: transformers' own validation names it
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LoadError(fix(f"config.json has {key}={value!r}; a model size must be a whole number of at least 1.",
                                f"correct {key} in config.json (save_pretrained() writes it), or use the checkpoint "
                                "as published."))


def read_dims(config, arch: Arch) -> Dims:
    check_sizes(config, arch)
    n_heads = config.num_attention_heads
    d_model = config.hidden_size
    d_mlp = next((getattr(config, k) for k in arch.d_mlp_keys if getattr(config, k, None)), 4 * d_model)
    if arch.moe is not None and arch.moe.dense_first_key is None:
        _check_every_layer_sparse(config, arch)
    from interp_engine.arch.layers import layer_kinds, layer_sizes

    width = lambda keys: next((config_value(config, k) for k in keys if config_value(config, k)), 0)  # noqa: E731
    heads = dict(n_kv_heads=config_value(config, "num_key_value_heads") or n_heads,
                 d_head=width(arch.d_head_keys) or d_model // n_heads)
    return Dims(
        n_layers=config.num_hidden_layers,
        d_model=d_model,
        n_heads=n_heads,
        **heads,
        d_head_v=width(arch.d_head_v_keys),
        d_latent=getattr(config, arch.d_latent_key) if arch.d_latent_key else 0,
        layer_kinds=layer_kinds(config, arch),
        layer_sizes=layer_sizes(config, arch, {**heads, "d_mlp": d_mlp}),
        d_mlp=d_mlp,
        d_vocab=config.vocab_size,
        max_len=getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 2**31,
        n_experts=getattr(config, arch.moe.n_experts_key) if arch.moe is not None else 0,
        top_k=getattr(config, arch.moe.top_k_key) if arch.moe is not None else 0,
        **({"n_lin_k_heads": config.linear_num_key_heads, "n_lin_v_heads": config.linear_num_value_heads,
            "d_lin_k": config.linear_key_head_dim, "d_lin_v": config.linear_value_head_dim}
           if arch.linear_attention else {}),
    )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """`model.cfg`: TransformerLens's names for what a checkpoint is. n_ctx is the model's own context length
    (a vLLM handle loaded with max_model_len= takes prompts of at most max_model_len - 1 tokens)."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    n_ctx: int
    family: str
    normalization: str
    positional: str
    act_fn: str


def read_cfg(config, arch: Arch, dims: Dims) -> ModelConfig:
    act = next((getattr(config, k) for k in ("hidden_activation", "hidden_act", "activation_function")
                if isinstance(getattr(config, k, None), str)), "unknown")
    return ModelConfig(n_layers=dims.n_layers, d_model=dims.d_model, n_heads=dims.n_heads, n_kv_heads=dims.n_kv_heads,
                       d_head=dims.d_head, d_mlp=dims.d_mlp, d_vocab=dims.d_vocab, n_ctx=dims.max_len,
                       family=arch.family, normalization=arch.normalization, positional=arch.positional, act_fn=act)


def _check_every_layer_sparse(config, arch: Arch) -> None:
    """Qwen3-MoE can make some layers dense (`mlp_only_layers`, `decoder_sparse_step`); no published checkpoint
    does, and a point set that changes per layer is not served: refused at load."""
    for key in (arch.moe.n_experts_key, arch.moe.top_k_key):
        value = getattr(config, key, None)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LoadError(fix(f"config.json has {key}={value!r}; a {arch.family} model needs at least 1.",
                                f"correct {key} in config.json, or use the checkpoint as published."))
    dense = list(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense += [i for i in range(config.num_hidden_layers) if (i + 1) % step and i not in dense]
    if dense:
        raise LoadError(fix(f"this {arch.family} config makes layers {sorted(dense)} dense (mlp_only_layers / "
                            "decoder_sparse_step); interp_engine serves mixture-of-experts models whose every "
                            "layer has experts.",
                            "set mlp_only_layers=[] and decoder_sparse_step=1, as the published checkpoints do."))


def moe_families() -> tuple[str, ...]:
    return tuple(sorted({arch.family for arch in _registry().values() if arch.moe is not None}))


def linear_families() -> tuple[str, ...]:
    return tuple(sorted({arch.family for arch in _registry().values() if arch.linear_attention is not None}))


@functools.cache  # the vLLM worker asks it at every hook install (the family's routing): built once
def _registry() -> Mapping[str, Arch]:
    from interp_engine.arch import (deepseek_v3, gemma2, gemma3, gemma4, gpt2, gpt_neox, gpt_oss, llama, mixtral, olmo2,
                                    phi, phi3, qwen3_moe, qwen3_next)

    table: dict[str, Arch] = {}
    for module in (llama, gemma2, gemma3, gemma4, gpt2, gpt_neox, phi, phi3, olmo2, qwen3_moe, mixtral, gpt_oss,
                   deepseek_v3, qwen3_next):
        for arch in module.ARCHES:
            for model_type in arch.model_types:
                table[model_type] = arch
    return MappingProxyType(table)


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_registry()))


def vllm_model_types() -> tuple[str, ...]:
    """The model types whose family has a vLLM layout."""
    return tuple(sorted(t for t, arch in _registry().items() if arch.vllm is not None))


def table_for(config) -> Arch | None:
    """The family table of config.model_type (an alias's: vLLM reads Kimi-K2's as kimi_k2), or None."""
    from interp_engine.arch.aliases import ALIASES

    kind = getattr(config, "model_type", None)
    arch = _registry().get(ALIASES.get(kind, kind))
    if arch is not None and arch.moe is not None and not arch.moe.enabled(config):
        return replace(arch, moe=None)  # a dense checkpoint of a family with MoE ones (Gemma 4's E2B, 31B)
    return arch


def arch_for(config, *, name: str = "this model") -> Arch:
    """The table of config.model_type; else the residual stream found in the model's structure (or a refusal
    saying what was looked for)."""
    from interp_engine.arch.discover import discover

    return table_for(config) or discover(config, name=name)


def families_with(point: str) -> tuple[str, ...]:
    """The table families that serve `point`, for refusals."""
    return tuple(dict.fromkeys(a.family for a in _registry().values() if a.serves(point) and not a.lacks(point)))
