"""Phi (1, 1.5, 2): one LayerNorm feeds attention and MLP in parallel; partial rotary; biased lm_head.

resid_mid is resid_pre + attn_out, as for GPT-NeoX.

vLLM 0.32 runs PhiForCausalLM through its Transformers backend (HF's modules, batched: see arch/olmo2.py);
attn_out is the output projection's output (the attention module returns a tuple, and its dropout is shared with
the MLP). resid_mid is formed there from the layer's input and attn_out, as for GPT-NeoX.
"""

from interp_engine.arch import Arch, VllmLayout

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
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.final_layernorm",
            attention="self_attn.attn.attn",  # behind a module that calls it (compat.model)
            o_proj="self_attn.dense",
            attn_out="self_attn.dense",
            mlp_out="mlp",
            mlp_pre="mlp.fc1",
            mlp_down="mlp.fc2",
            stream_out="batched",
            parallel=True,
        ),
    ),
)
