"""Qwen3-MoE: Qwen3's attention (q/k norms inside it) with a sparse MLP in every layer: a router (`mlp.gate`)
picks the top k of `num_experts` experts per token from the softmax of its logits, renormalised when
`norm_topk_prob`; no shared expert. `mlp_out` is the block's output (the weighted sum of the chosen experts, what
the residual stream receives); `router_logits` the gate's output, before the softmax. There is no `mlp_act`."""

import dataclasses

from interp_engine.arch import Moe, llama

# Llama's module paths (Qwen3's), in HF and in vLLM, with the sparse MLP's router where the down projection was.
_LLAMA = llama.ARCHES[0]
ARCHES = (dataclasses.replace(
    _LLAMA, family="qwen3_moe", model_types=("qwen3_moe",), mlp_down=None, mlp_pre=None, mlp_up=None,
    d_mlp_keys=("moe_intermediate_size",),
    moe=Moe(router="mlp.gate", n_experts_key="num_experts", renormalize="norm_topk_prob"),
    vllm=dataclasses.replace(_LLAMA.vllm, mlp_down=None, router="mlp.gate")),)
