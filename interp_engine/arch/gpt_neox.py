"""GPT-NeoX (Pythia): fused qkv, partial rotary, attention and MLP in parallel off resid_pre.

With a parallel block there is no residual between attention and MLP; resid_mid is resid_pre + attn_out,
the stream after attention alone, and writing it changes resid_post but not the MLP's input.

vLLM 0.32 runs GPTNeoXForCausalLM through its Transformers backend (HF's modules, batched: see arch/olmo2.py);
attn_out and mlp_out are the outputs of the dropouts after attention and MLP (identities at inference: the
attention module itself returns a tuple). No module there sees resid_mid either: the worker forms it at attn_out's
output from the layer's input, and writes it through attn_out, as eager does (`VllmLayout.parallel`).
"""

from interp_engine.arch import Arch, VllmLayout

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
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.final_layer_norm",
            attention="attention.attn.attn",  # behind a module that calls it (compat.model)
            o_proj="attention.dense",
            attn_out="post_attention_dropout",
            mlp_out="post_mlp_dropout",
            mlp_pre="mlp.dense_h_to_4h",
            mlp_down="mlp.dense_4h_to_h",
            stream_out="batched",
            parallel=True,
        ),
    ),
)
