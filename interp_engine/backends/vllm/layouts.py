"""A model's vLLM layout (the family's, or one found in vLLM's module tree) and its tensor-parallel shards."""

from interp_engine.backends.vllm import compat
from interp_engine.backends.vllm.shards import Shards


def layout_of(runner):
    """The family's vLLM layout; for a model type without a table, the one found in vLLM's module tree (once
    per model: it walks every module)."""
    from interp_engine.arch import table_for

    config, model = compat.hf_config(runner), compat.model(runner)
    arch = table_for(config)
    if arch is not None:
        return arch.vllm
    if getattr(model, "_ie_layout", None) is None:
        from interp_engine.backends.vllm.discover import discover_layout

        model._ie_layout = discover_layout(model, config)
    return model._ie_layout


def shards_of(runner, layout) -> Shards:
    from interp_engine.arch import read_dims, table_for

    config = compat.hf_config(runner)
    if layout.attention is None:  # a discovered layout: residual-stream points only, none sharded
        return Shards(config)
    # A hybrid's first layers may be Gated DeltaNets: head counts are read at its first attention layer.
    layer = next(layer for layer in compat.model(runner).get_submodule(layout.layers)
                 if layout.linear_attn is None or not hasattr(layer, layout.linear_attn))
    down = compat.input_width(layer.get_submodule(layout.mlp_down)) if layout.mlp_down is not None else 0
    return Shards(config, layer.get_submodule(layout.attention), down, read_dims(config, table_for(config)).n_experts)
