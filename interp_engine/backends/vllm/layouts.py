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
    layer = compat.model(runner).get_submodule(layout.layers)[0]
    if layout.attention is None:  # a discovered layout: residual-stream points only, none sharded
        return Shards(config)
    down = compat.input_width(layer.get_submodule(layout.mlp_down)) if layout.mlp_down is not None else 0
    dims = read_dims(config, table_for(config))
    shards = Shards(config, layer.get_submodule(layout.attention), down, dims.n_experts)
    if dims.layer_sizes:  # layers of their own widths (Gemma 4): each layer's own modules say its shards
        shards.layers = tuple(shards.at(one.get_submodule(layout.attention), dims.at(i).n_kv_heads,
                                        compat.input_width(one.get_submodule(layout.mlp_down)))
                              for i, one in enumerate(compat.model(runner).get_submodule(layout.layers)))
    return shards
