"""Phi (1, 1.5, 2): one LayerNorm feeds attention and MLP in parallel; partial rotary; biased lm_head.

resid_mid is resid_pre + attn_out, as for GPT-NeoX.
"""

from interp_engine.arch import Arch

ARCHES = (
    Arch(
        family="phi",
        model_types=("phi",),
        layers="model.layers",
        final_norm="model.final_layernorm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="self_attn",
        mlp_out="mlp",
        normalization="layernorm",
        mlp_pre="mlp.fc1",
        mlp_down="mlp.fc2",
        parallel=True,
    ),
)
