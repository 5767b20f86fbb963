"""GPT-2: fused qkv (Conv1D), learned positions, LayerNorm.

On vLLM (its native gpt2.py) a block takes and returns the stream alone (`stream_out="first"`) and no positions
(the worker takes the step's from the model's forward); ln_2's input is the stream the block adds the MLP's output
to, as on HF; c_attn is vLLM's QKVParallelLinear (Conv1D's weights transposed at load) and embed includes the
learned positions, as on eager.
"""

from interp_engine.arch import Arch, VllmLayout

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
        vllm=VllmLayout(
            layers="transformer.h",
            final_norm="transformer.ln_f",
            attention="attn.attn",
            o_proj="attn.c_proj",
            attn_out="attn",
            mlp_out="mlp",
            mlp_pre="mlp.c_fc",
            mlp_down="mlp.c_proj",
            mid_norm="ln_2",
            stream_out="first",
        ),
    ),
)
