"""Reads vLLM never forms, recomputed in the worker from what it does form, for the `vllm` backend's hooks
(and, for expert_weights, vllm-static's step): one place for each formula, every rank running the same gathers."""

import torch
from torch import Tensor

from interp_engine.backends.vllm import compat, compat_modules, wire
from interp_engine.errors import fix


class Unserved(Exception):
    """A recomputed read this engine cannot serve; the message is the whole refusal, fix included."""


def routing_of(runner):
    """For a mixture-of-experts model, (a layer's gate module, the layer) -> `route`'s arguments after the logits
    (DeepSeek's take the gate's own correction bias, Gemma 4's the layer's per-expert scale); None for a dense
    model."""
    from interp_engine.arch import table_for

    config = compat.hf_config(runner)
    arch = table_for(config)  # a discovered model has no experts (and no table: never discovered again here)
    return (lambda gate, layer: arch.moe.routing(config, gate, layer)) if arch is not None and arch.moe is not None \
        else None


def expert_weights(logits, routing: tuple):
    from interp_engine.arch.routing import dense_weights, route

    return dense_weights(*route(logits, *routing), logits.shape[-1])


def head_results(shards, z: Tensor, o_proj) -> Tensor:
    """attn_result, [rows, n_heads, d_model]: each head's z (gathered, after any edit at z) times its rows of W_O,
    o_proj's bias left out, as on eager. o_proj is row-parallel: this rank's weight columns are its own heads'
    rows of W_O, so each rank multiplies its heads and the products are gathered (no weight crosses ranks)."""
    if (method := compat_modules.quantized(o_proj)) is not None:
        raise Unserved(fix(f"attn_result is z times o_proj's plain weight, and this engine's is quantized ({method}).",
                           "read z and attn_out here, or load the checkpoint without quantization= to read "
                           "attn_result."))
    mine = shards.split("z", z)  # [rows, local heads, d_head]
    w = o_proj.weight  # [d_model, local heads * d_head]
    return shards.gather(torch.einsum("rhe,mhe->rhm", mine, w.view(len(w), mine.shape[1], -1)), 1)


def record(state, address, compute) -> None:
    """Touch `address` with `compute()`; a failure (a quantized o_proj, say) fails the calls that read it, not the
    step (an exception out of a hook would end the engine)."""
    try:
        value = compute()
    except Exception as e:
        for active in state.active:
            if active.call.wants(address):
                active.call.fail(str(e) if isinstance(e, Unserved) else wire.recording_failed(address, e),
                                 in_spec=False)
        return
    state.touch(address, value, fresh=True)
