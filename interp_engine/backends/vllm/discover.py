"""A discovered model's layout in vLLM's module tree (the worker side of `interp_engine/arch/discover.py`).

The same structure as on HF: the one ModuleList of num_hidden_layers decoder layers of one class, and the final
norm beside it. What a layer hands on decides how the stream is read: a layer that takes no `residual` reads the
stream itself, so what it returns (alone or first of a tuple) is the stream ("first"). A layer that takes one
follows vLLM's fused add-norm convention (the stream is hidden + residual, "sum") only if the norms add it:
that holds where the final norm is vLLM's fused RMSNorm; any other (Cohere's LayerNorm, which drops the
residual) is refused rather than guessed.
"""

import inspect

from interp_engine.arch import VllmLayout
from interp_engine.arch.discover import NORM_NAMES, find_layer_stack, has_module, layer_count
from interp_engine.backends.vllm import compat_modules
from interp_engine.errors import LoadError, fix


def discover_layout(model, config) -> VllmLayout:
    n_layers = layer_count(config)
    layers, seen = find_layer_stack(model, n_layers)
    parent = layers.rpartition(".")[0]
    beside = (f"{parent}.{n}" if parent else n for n in NORM_NAMES)
    norms = [p for p in beside if has_module(model, p)] if layers else []
    if not layers or len(norms) != 1:
        found = f"the layers at {layers!r} and final norms {norms}" if layers else ", ".join(seen) or "no ModuleList"
        raise LoadError(fix(
            f"vLLM's {type(model).__name__} has no layout interp_engine can find: it looked for one ModuleList of "
            f"num_hidden_layers={n_layers} decoder layers and one of {', '.join(NORM_NAMES)} beside it, and found "
            f"{found}.", 'use backend="eager" for this model.'))
    params = list(inspect.signature(model.get_submodule(layers)[0].forward).parameters)
    if params[:2] != ["positions", "hidden_states"]:  # what the layer hooks unpack (sites.STREAM_IN)
        raise LoadError(fix(
            f"vLLM's {type(model).__name__} runs layers that take ({', '.join(params)}), not vLLM's own "
            "(positions, hidden_states, ...): it is not a native vLLM implementation (vLLM's Transformers "
            "fallback runs HF's layers), and interp_engine finds the stream only in native ones.",
            'use backend="eager" for this model.'))
    takes_residual = "residual" in params
    norm = model.get_submodule(norms[0])
    if takes_residual and not compat_modules.adds_residual(norm):
        raise LoadError(fix(
            f"vLLM's {type(model).__name__} passes a residual between its layers, and its final norm "
            f"({type(norm).__name__}) is not vLLM's fused add-norm, so whether the stream is hidden + residual or "
            "hidden alone cannot be told from the structure.", 'use backend="eager" for this model.'))
    return VllmLayout(layers=layers, final_norm=norms[0], stream_out="sum" if takes_residual else "first")

