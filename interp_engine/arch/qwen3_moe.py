"""Qwen3-MoE: Qwen3's attention (q/k norms inside it) with a sparse MLP in every layer: a router (`mlp.gate`)
picks the top k of `num_experts` experts per token from the softmax of its logits, renormalised when
`norm_topk_prob`; no shared expert. `mlp_out` is the block's output (the weighted sum of the chosen experts, what
the residual stream receives); `router_logits` the gate's output, before the softmax. There is no `mlp_act`."""

from interp_engine.arch import Arch, Moe, VllmLayout

ARCHES = (
    Arch(
        family="qwen3_moe",
        model_types=("qwen3_moe",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="self_attn",
        mlp_out="mlp",
        mlp_down=None,
        mid_norm="post_attention_layernorm",
        d_mlp_keys=("moe_intermediate_size",),
        moe=Moe(router="mlp.gate", n_experts_key="num_experts", renormalize="norm_topk_prob"),
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.norm",
            attention="self_attn.attn",
            o_proj="self_attn.o_proj",
            attn_out="self_attn",
            mlp_out="mlp",
            mlp_down=None,
            mid_norm="post_attention_layernorm",
            router="mlp.gate",
        ),
    ),
)
