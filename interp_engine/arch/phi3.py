"""Phi-3 (and Phi-3.5, Phi-4-mini's text layout): Llama's sequential block with fused qkv_proj and gate_up_proj.
Points are read where Llama's are (q/k/v at the attention function, after the split and rotary; mlp_act at the
down projection's input), so the fusion changes no path. vLLM implements it as a Llama subclass."""

from interp_engine.arch import Arch, VllmLayout

ARCHES = (
    Arch(
        family="phi3",
        model_types=("phi3",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="self_attn",
        mlp_out="mlp",
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
            mid_norm="post_attention_layernorm",
        ),
    ),
)
