"""OLMo 2: no pre-norms; RMS norms after attention and after the MLP, so attn_out/mlp_out are those norms' outputs;
q/k RMS norms over the whole projection (all heads at once) inside attention. resid_mid is the MLP's own input
(no norm sits between the residual add and the MLP).

vLLM 0.32 has no native OLMo 2 model: it serves Olmo2ForCausalLM through its Transformers fallback, whose layers
do not follow vLLM's (hidden, residual) convention, so the vLLM backends refuse it (`vllm_refusal`)."""

from interp_engine.arch import Arch

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
        vllm_refusal="vLLM 0.32 has no native OLMo 2 implementation (it runs Olmo2ForCausalLM through its "
                     "Transformers fallback, whose layers have none of the sites interp_engine hooks)",
    ),
)
