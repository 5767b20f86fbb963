"""Per-layer point sets, as data: a model whose layers differ (DeepSeek-V3's first dense layers before its
mixture-of-experts ones) lists, per layer, the kinds that layer is (`Dims.layer_kinds`, read from the config
once at load); each kind lacks some points (`LACKS`). `validate.plan` asks `lacking` for every address before any
forward, and `model.points()` lists a layer's point only where its kinds have it. A family whose every layer
is alike has no kinds (`()`), and only `Arch.lacks` (the family's) applies.

A new kind is a row in `LACKS` and a branch in `layer_kinds`; a layer can be several kinds at once (a
hybrid with dense first layers would have ("linear_attention", "moe")): it lacks the union. Hybrid linear
attention's kinds come from the config's `layer_types`; Qwen3-Next has experts in every layer, so that is its
family's (`Arch.moe`), not a kind. A layer whose sizes differ (Gemma 4's global layers' head width, its KV-shared
layers' double-wide MLP) says so in `Dims.layer_sizes` (`layer_sizes`), which `validate.feature_shape` and the
result check ask (`Dims.at`).
"""

from interp_engine.errors import fix

# A linear-attention (Gated DeltaNet) layer's own points, which a softmax-attention layer lacks.
LINEAR_POINTS = ("lin_q", "lin_k", "lin_v", "lin_beta", "lin_g", "lin_z", "lin_out")

# Per kind: the points a layer of that kind has not, and what it is (for the refusal).
LACKS: dict[str, tuple[tuple[str, ...], str]] = {
    "dense": (("router_logits", "expert_weights", "expert_out"), "a dense MLP"),
    "moe": (("mlp_act", "mlp_pre", "mlp_pre_linear"), "a mixture of experts"),
    "linear_attention": (("q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result"),
                         "a linear-attention (Gated DeltaNet) layer, with no softmax attention"),
    "full_attention": (LINEAR_POINTS, "a softmax-attention layer"),
    "kv_shared": (("k", "v"), "a KV-shared layer, attending over the keys and values of the last earlier layer of "
                              "its type (num_kv_shared_layers)"),
}


def layer_kinds(config, arch) -> tuple[tuple[str, ...], ...]:
    """Each layer's kinds as `config` sets them; () where every layer is alike."""
    n, moe, shared = config.num_hidden_layers, arch.moe, kv_shared_layers(config, arch)
    mlp: tuple[tuple[str, ...], ...] = ((),) * n
    if moe is not None and moe.dense_first_key is not None:
        first = getattr(config, moe.dense_first_key, 0) or 0
        mlp = tuple(("dense",) if i < first else ("moe",) for i in range(n))
    mixer = ((),) * n
    if arch.linear_attention is not None:
        mixer = tuple(("linear_attention",) if t == "linear_attention" else ("full_attention",)
                      for t in config.layer_types)
    kv = tuple(("kv_shared",) if i in shared else () for i in range(n))
    kinds = tuple(a + b + c for a, b, c in zip(mixer, kv, mlp))
    return kinds if any(kinds) else ()


def kv_shared_layers(config, arch) -> range:
    """The layers that reuse an earlier layer's keys and values (Gemma 4's last num_kv_shared_layers)."""
    n = config.num_hidden_layers
    count = (getattr(config, arch.kv_shared_key, 0) or 0) if arch.kv_shared_key else 0
    return range(n - count, n) if 0 < count < n else range(0)


def kv_sources(config, arch) -> dict[int, int]:
    """KV-shared layer -> the layer whose keys and values it attends over: the last earlier layer of its own
    `layer_types` type that computes its own (as HF and vLLM pick it)."""
    shared, types = kv_shared_layers(config, arch), getattr(config, "layer_types", None)
    own = range(shared.start) if shared else range(0)
    return {i: max(j for j in own if types[j] == types[i]) for i in shared}


def layer_sizes(config, arch, sizes: dict[str, int]) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per layer, the (name, size) pairs in which it differs from `sizes` (the model's d_head, n_kv_heads, d_mlp):
    a heterogeneous config's per-layer head width and KV head count (Gemma 4's global layers), and a KV-shared
    layer's doubled MLP where the family's flag says so; () where every layer has the model's sizes."""
    per = config.per_layer_config if getattr(config, "is_heterogeneous", False) else None
    wide = kv_shared_layers(config, arch) if arch.double_wide_key and getattr(config, arch.double_wide_key, False) \
        else range(0)
    out = []
    for i in range(config.num_hidden_layers):
        own = {}
        for name, key in (("n_kv_heads", "num_key_value_heads"), ("d_head", "head_dim")):
            size = getattr(per[i], key, None) if per is not None else None
            if size and size != sizes[name]:
                own[name] = size
        if i in wide:
            own["d_mlp"] = 2 * sizes["d_mlp"]
        out.append(tuple(own.items()))
    return tuple(out) if any(out) else ()


def config_value(config, key: str):
    """`config.key`, or None. A heterogeneous config (Gemma 4's per-layer head widths) refuses a per-layer key read
    globally; its global value is the model's, each layer's own is in `Dims.layer_sizes` (`layer_sizes`)."""
    plain = getattr(type(config), "_getattr_without_heterogeneous_validation", None)
    if plain is not None and getattr(config, "is_heterogeneous", False):
        return plain(config, key, None)
    return getattr(config, key, None)


def lacking(point: str, layer: int, kinds: tuple[tuple[str, ...], ...]) -> str | None:
    """Why layer `layer` (resolved, in range) has no `point`, naming the layers that have it; None if it has."""
    if not kinds or layer is None:
        return None
    for kind in kinds[layer]:
        lacks, what = LACKS[kind]
        if point in lacks:
            have = [i for i, ks in enumerate(kinds) if not any(point in LACKS[k][0] for k in ks)]
            where = f"layer{'s' if len(have) > 1 else ''} {_ranges(have)}" if have else "no layer of this model"
            return fix(f"layer {layer} is {what} ({kind}), which has no {point}; {point} is at {where}.",
                       f"use {point} at {where}." if have else f"use another point at layer {layer}.")
    return None


def _ranges(layers: list[int]) -> str:
    """[1, 2, 3, 7] -> "1-3, 7"."""
    out, start = [], None
    for i, n in enumerate(layers):
        if start is None:
            start = n
        if i + 1 == len(layers) or layers[i + 1] != n + 1:
            out.append(str(start) if start == n else f"{start}-{n}")
            start = None
    return ", ".join(out)
