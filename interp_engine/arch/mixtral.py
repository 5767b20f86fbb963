"""Mixtral: Mistral's attention with a sparse MLP in every layer: a router (`mlp.gate`; vLLM's
`block_sparse_moe.gate`) picks the top k of `num_local_experts` experts per token from the softmax of its logits,
always renormalised. `mlp_out` is the block's output (the weighted sum of the chosen experts); `router_logits`
the gate's output, before the softmax. There is no `mlp_act`."""

from interp_engine.arch import Arch, Moe, VllmLayout

ARCHES = (
    Arch(
        family="mixtral",
        model_types=("mixtral",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="self_attn",
        mlp_out="mlp",
        mlp_down=None,
        mid_norm="post_attention_layernorm",
        moe=Moe(router="mlp.gate", n_experts_key="num_local_experts", renormalize=True),
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.norm",
            attention="self_attn.attn",
            o_proj="self_attn.o_proj",
            attn_out="self_attn",
            mlp_out="block_sparse_moe",
            mlp_down=None,
            mid_norm="post_attention_layernorm",
            router="block_sparse_moe.gate",
        ),
    ),
)
