"""Gemma 3 (text): Gemma-2's four norms per layer, so attn_out/mlp_out are the post-norms' outputs; q/k RMS norms
per head inside attention (q and k are read after them and after rotary); sliding and global layers as
`layer_types` says, each with its own rotary base; embeddings scaled by sqrt(d_model) inside the embedding
module, so `embed` is the scaled one (what layer 0 reads). No softcapping in the published configs."""

from interp_engine.arch import Arch, VllmLayout

ARCHES = (
    Arch(
        family="gemma3",
        model_types=("gemma3_text",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="post_attention_layernorm",
        mlp_out="post_feedforward_layernorm",
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
            mid_norm="pre_feedforward_layernorm",
        ),
    ),
)
