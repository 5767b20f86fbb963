"""GPT-2: fused qkv (Conv1D), learned positions, LayerNorm."""

from interp_engine.arch import Arch

ARCHES = (
    Arch(
        family="gpt2",
        model_types=("gpt2",),
        layers="transformer.h",
        final_norm="transformer.ln_f",
        unembed="lm_head",
        attention="attn",
        attn_out="attn",
        mlp_out="mlp",
        normalization="layernorm",
        positional="learned",
        mlp_pre="mlp.c_fc",
        mlp_down="mlp.c_proj",
        mid_norm="ln_2",
        d_mlp_keys=("n_inner",),
    ),
)
