"""Per-layer point sets, as data: a model whose layers differ (DeepSeek-V3's first dense layers before its
mixture-of-experts ones) lists, per layer, the kinds that layer is (`Dims.layer_kinds`, read from the config
once at load); each kind lacks some points (`LACKS`). `validate.plan` asks `lacking` for every address before any
forward, and `model.points()` lists a layer's point only where its kinds have it. A family whose every layer
is alike has no kinds (`()`), and only `Arch.lacks` (the family's) applies.

A new kind (a Gemma 4 layer with its own head width) is a row in `LACKS` and a branch in `layer_kinds`; a layer
can be several kinds at once (a hybrid with dense first layers would have ("linear_attention", "moe")): it lacks
the union. Hybrid linear attention's kinds come from the config's `layer_types`; Qwen3-Next has experts in every
layer, so that is its family's (`Arch.moe`), not a kind.
"""

from interp_engine.arch import LINEAR_POINTS
from interp_engine.errors import fix

# Per kind: the points a layer of that kind has not, and what it is (for the refusal).
LACKS: dict[str, tuple[tuple[str, ...], str]] = {
    "dense": (("router_logits", "expert_weights", "expert_out"), "a dense MLP"),
    "moe": (("mlp_act", "mlp_pre", "mlp_pre_linear"), "a mixture of experts"),
    "linear_attention": (("q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result"),
                         "a linear-attention (Gated DeltaNet) layer, with no softmax attention"),
    "full_attention": (LINEAR_POINTS, "a softmax-attention layer"),
}


def layer_kinds(config, arch) -> tuple[tuple[str, ...], ...]:
    """Each layer's kinds as `config` sets them; () where every layer is alike."""
    n, moe = config.num_hidden_layers, arch.moe
    mlp: tuple[tuple[str, ...], ...] = ((),) * n
    if moe is not None and moe.dense_first_key is not None:
        first = getattr(config, moe.dense_first_key, 0) or 0
        mlp = tuple(("dense",) if i < first else ("moe",) for i in range(n))
    mixer = ((),) * n
    if arch.linear_attention is not None:
        mixer = tuple(("linear_attention",) if t == "linear_attention" else ("full_attention",)
                      for t in config.layer_types)
    kinds = tuple(a + b for a, b in zip(mixer, mlp))
    return kinds if any(kinds) else ()


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
