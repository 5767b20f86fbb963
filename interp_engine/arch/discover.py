"""Any other decoder-only model at the residual stream: its `Arch` found from the model's own structure.

An architecture without a table still has a stack of decoder layers, an embedding, an unembedding and a norm
between the last layer and the unembedding. `discover` builds the model on the meta device (no weights, no
memory), finds those four, and returns an `Arch` that serves only the points they fix: `RESIDUAL_POINTS`. The
backends then use it through the same hooks as a table's (the layer's input, the layer's output, the final
norm's output). On vLLM the worker finds the same modules in vLLM's tree (`backends/vllm/discover.py`).
"""

import torch

from interp_engine.arch import Arch, supported_model_types
from interp_engine.errors import LoadError, fix

# The points a discovered model serves: where each sits needs only the layer stack and the final norm.
RESIDUAL_POINTS = ("embed", "resid_pre", "resid_post", "final", "logits")

# The final norm's usual names, next to the layer stack: used only where the traced forward cannot say.
NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm")


def layer_count(config) -> int | None:
    for key in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def find_layer_stack(model: torch.nn.Module, n_layers: int | None) -> tuple[str, list[str]]:
    """(path, every ModuleList seen with its length): the one ModuleList of `n_layers` modules of one class."""
    seen, found = [], []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            seen.append(f"{name} ({len(module)})")
            if len(module) == n_layers and len({type(m) for m in module}) == 1:
                found.append(name)
    return (found[0] if len(found) == 1 else ""), seen


def _refuse(model_type: str, name: str, what: str) -> LoadError:
    return LoadError(fix(
        f"{name!r} is a {model_type!r} model, which has no table in interp_engine, and its structure cannot be "
        f"discovered: {what}",
        f"use a model of a covered family ({', '.join(supported_model_types())}), or add a table for "
        f"{model_type!r} in interp_engine/arch/."))


def _path_of(model: torch.nn.Module, target: torch.nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if m is target), None) if target is not None else None


def _traced_final_norm(model: torch.nn.Module, last_layer: str, unembed: str) -> list[str]:
    """The outermost modules that run after the last layer returns and before the unembedding starts, in one
    forward on the meta device."""
    events: list[tuple[str, str]] = []
    handles = []
    for name, module in model.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: events.append(("pre", n))))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: events.append(("post", n))))
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    start = max(i for i, e in enumerate(events) if e == ("post", last_layer))
    stop = next(i for i, e in enumerate(events) if e == ("pre", unembed) and i > start)
    between = [n for kind, n in events[start + 1:stop] if kind == "pre"]
    return [n for n in between if not any(n.startswith(f"{o}.") for o in between)]


def discover(config, *, name: str = "this model") -> Arch:
    """The `Arch` of a model type without a table, found in the model built from `config` on the meta device."""
    from transformers import AutoModelForCausalLM

    model_type = getattr(config, "model_type", None)
    n_layers = layer_count(config)
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001  (transformers' own reason, whatever it raised)
        raise _refuse(model_type, name, f"transformers builds no causal LM from its config ({e}).") from None
    layers, seen = find_layer_stack(model, n_layers)
    if not layers:
        raise _refuse(model_type, name, f"looked for exactly one torch.nn.ModuleList of num_hidden_layers="
                                        f"{n_layers} modules of one class, found {', '.join(seen) or 'no ModuleList'}.")
    unembed = _path_of(model, model.get_output_embeddings())
    if unembed is None or model.get_input_embeddings() is None:
        raise _refuse(model_type, name, "get_input_embeddings() or get_output_embeddings() returns no module.")
    last = f"{layers}.{n_layers - 1}"
    try:
        norms = _traced_final_norm(model, last, unembed)
    except Exception:  # noqa: BLE001  a forward that meta tensors cannot run: the usual names decide
        parent = layers.rpartition(".")[0]
        norms = [p for p in (f"{parent}.{n}" if parent else n for n in NORM_NAMES)
                 if has_module(model, p)]
    if len(norms) != 1:
        raise _refuse(model_type, name, f"looked for one module run between the last decoder layer ({last}) and "
                                        f"the unembedding ({unembed}), found {norms or 'none'}.")
    # The norm's kind (model.cfg, apply_ln_to_stack): a LayerNorm subtracts the mean; anything else is taken as RMS.
    layer_norm = isinstance(model.get_submodule(norms[0]), torch.nn.LayerNorm)
    return Arch(family=f"discovered:{model_type}", model_types=(model_type,), layers=layers, final_norm=norms[0],
                unembed=unembed, points=RESIDUAL_POINTS, normalization="layernorm" if layer_norm else "rmsnorm")


def has_module(model: torch.nn.Module, path: str) -> bool:
    """Whether `model` has a submodule at `path`: the one way the package asks (vLLM's module tree included)."""
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True
