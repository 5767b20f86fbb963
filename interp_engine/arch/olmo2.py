"""OLMo 2: no pre-norms; RMS norms after attention and after the MLP, so attn_out/mlp_out are those norms' outputs;
q/k RMS norms over the whole projection (all heads at once) inside attention. resid_mid is the MLP's own input
(no norm sits between the residual add and the MLP).

vLLM 0.32 has no native OLMo 2 model: it runs Olmo2ForCausalLM through its Transformers backend, HF's own modules
with vLLM's parallel linears (q/k/v merged into qkv_proj, gate/up into gate_up_proj), RMS norms and attention
swapped in; every tensor between them keeps HF's batch axis of one (`stream_out="batched"`). Its q/k norms see
the whole projection at any tensor-parallel size (vLLM gathers it), so q and k mean what they mean on eager.
"""

from interp_engine.arch import Arch, VllmLayout

ARCHES = (
    Arch(
        family="olmo2",
        model_types=("olmo2",),
        layers="model.layers",
        final_norm="model.norm",
        unembed="lm_head",
        attention="self_attn",
        attn_out="post_attention_layernorm",
        mlp_out="post_feedforward_layernorm",
        mlp_pre="mlp.gate_proj",
        mlp_up="mlp.up_proj",
        mlp_down="mlp.down_proj",
        mid_norm="mlp",
        vllm=VllmLayout(
            layers="model.layers",
            final_norm="model.norm",
            attention="self_attn.attn.attn",  # behind a module that calls it (compat.model)
            o_proj="self_attn.o_proj",
            attn_out="post_attention_layernorm",
            mlp_out="post_feedforward_layernorm",
            mlp_down="mlp.down_proj",
            mlp_in="mlp.gate_up_proj",
            mid_norm="mlp",
            stream_out="batched",
        ),
    ),
)
