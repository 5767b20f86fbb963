"""Gemma-2: extra norms after attention and MLP, so attn_out/mlp_out are those norms' outputs (what the
residual stream receives); attention logits are softcapped inside attention, final logits after the head."""

from interp_engine.arch import Arch, VllmLayout

ARCHES = (
    Arch(
        family="gemma2",
        model_types=("gemma2",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="post_attention_layernorm",
        mlp_out="post_feedforward_layernorm",
        normalization="gemma_rmsnorm",
        mlp_pre="mlp.gate_proj",
        mlp_up="mlp.up_proj",
        mlp_down="mlp.down_proj",
        mid_norm="pre_feedforward_layernorm",
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.norm",
            attention="self_attn.attn",
            o_proj="self_attn.o_proj",
            attn_out="post_attention_layernorm",
            mlp_out="post_feedforward_layernorm",
            mlp_down="mlp.down_proj",
            mlp_in="mlp.gate_up_proj",
            mid_norm="pre_feedforward_layernorm",
        ),
    ),
)
