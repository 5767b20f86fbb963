"""Llama and the families that share its layout: Mistral, Qwen2, Qwen3 (q/k norms live inside attention)."""

from interp_engine.arch import Arch, VllmLayout

ARCHES = (
    Arch(
        family="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="self_attn",
        mlp_out="mlp",
        mlp_pre="mlp.gate_proj",
        mlp_up="mlp.up_proj",
        mlp_down="mlp.down_proj",
        mid_norm="post_attention_layernorm",
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.norm",
            attention="self_attn.attn",
            o_proj="self_attn.o_proj",
            attn_out="self_attn",
            mlp_out="mlp",
            mlp_down="mlp.down_proj",
            mlp_in="mlp.gate_up_proj",
            mid_norm="post_attention_layernorm",
        ),
    ),
)
