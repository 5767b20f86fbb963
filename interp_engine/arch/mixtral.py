"""Mixtral: Mistral's attention with a sparse MLP in every layer: a router (`mlp.gate`; vLLM's
`block_sparse_moe.gate`) picks the top k of `num_local_experts` experts per token from the softmax of its logits,
always renormalised. `mlp_out` is the block's output (the weighted sum of the chosen experts); `router_logits`
the gate's output, before the softmax. There is no `mlp_act`."""

import dataclasses

from interp_engine.arch import Moe, llama

# Llama's module paths (Mistral's) with the sparse MLP's router; vLLM names the block `block_sparse_moe`.
_LLAMA = llama.ARCHES[0]
ARCHES = (dataclasses.replace(
    _LLAMA, family="mixtral", model_types=("mixtral",), mlp_down=None, mlp_pre=None, mlp_up=None,
    moe=Moe(router="mlp.gate", n_experts_key="num_local_experts", renormalize=True),
    vllm=dataclasses.replace(_LLAMA.vllm, mlp_out="block_sparse_moe", mlp_down=None,
                             router="block_sparse_moe.gate")),)
