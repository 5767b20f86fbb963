"""GPT-NeoX (Pythia): fused qkv, partial rotary, attention and MLP in parallel off resid_pre.

With a parallel block there is no residual between attention and MLP; resid_mid is resid_pre + attn_out,
the stream after attention alone, and writing it changes resid_post but not the MLP's input.
"""

from interp_engine.arch import Arch

ARCHES = (
    Arch(
        family="gpt_neox",
        model_types=("gpt_neox",),
        layers="gpt_neox.layers",
        final_norm="gpt_neox.final_layer_norm",
        unembed="lm_head",
        attention="attention",
        attn_out="attention",
        mlp_out="mlp",
        normalization="layernorm",
        mlp_pre="mlp.dense_h_to_4h",
        mlp_down="mlp.dense_4h_to_h",
        parallel=True,
    ),
)
