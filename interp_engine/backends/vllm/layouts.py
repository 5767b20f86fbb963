"""A model's vLLM layout (the family's, or one found in vLLM's module tree) and its tensor-parallel shards."""

from interp_engine.backends.vllm import compat, compat_modules
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

    from interp_engine.arch.discover import has_module

    config = compat.hf_config(runner)
    layers = compat.model(runner).get_submodule(layout.layers)
    if layout.attention is None and layout.mlp_down is None:  # a discovered layout: the stream only, none sharded
        return Shards(config)
    # The first layer with a dense MLP (DeepSeek's MoE layers have none); `mla` instead of attention under latent
    # attention.
    down = next((compat_modules.input_width(layer.get_submodule(layout.mlp_down)) for layer in layers
                 if layout.mlp_down is not None and has_module(layer, layout.mlp_down)), 0)
    # A hybrid's first layers may be Gated DeltaNets: head counts are read at its first attention layer.
    first = next(layer for layer in layers if layout.linear_attn is None or not has_module(layer, layout.linear_attn))
    attention = first.get_submodule(layout.attention) if layout.attention is not None else None
    latent = first.get_submodule(layout.mla) if layout.mla is not None else None
    dims = read_dims(config, table_for(config))
    shards = Shards(config, attention, down, dims.n_experts, dims.d_latent, latent)
    if dims.layer_sizes:  # layers of their own widths (Gemma 4): each layer's own modules say its shards
        shards.layers = tuple(shards.at(one.get_submodule(layout.attention), dims.at(i).n_kv_heads,
                                        compat_modules.input_width(one.get_submodule(layout.mlp_down)))
                              for i, one in enumerate(layers))
    return shards
