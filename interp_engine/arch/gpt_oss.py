"""GPT-OSS: Llama's layer layout with attention sinks, alternating sliding/full attention (`layer_types`) and a
sparse MLP in every layer: a router with a bias (`mlp.router`) picks the top k of `num_local_experts` experts
from its logits and softmaxes those k (the renormalised softmax's top k: the same weights); no shared expert.
The experts are a clamped SwiGLU with biases. `mlp_out` is the block's output (the weighted sum of the chosen
experts); `router_logits` the router's output, before any softmax. There is no `mlp_act`.

Sinks: each head has one learned logit appended to every query's scores before the softmax and dropped after
it, so a query may attend to nothing. The sink is not a key position: `attn_scores` holds the key positions'
scores only, and `attn_probs` the key positions' probabilities as the model uses them, so a row sums to less
than 1 (the rest is the sink's share). Editing `attn_scores` softmaxes the edited scores with the sink again."""

import dataclasses

from interp_engine.arch import Moe, VllmLayout, llama

# vLLM 0.32's gpt_oss.py: TransformerBlock(hidden, positions, residual) -> (hidden, residual) with fused add-norms,
# OAIAttention at `attn` (its Attention kernel holds the sinks), MLPBlock's GateLinear router feeding FusedMoE.
_LLAMA = llama.ARCHES[0]
ARCHES = (dataclasses.replace(
    _LLAMA, family="gpt_oss", model_types=("gpt_oss",), mlp_down=None, mlp_pre=None, mlp_up=None,
    moe=Moe(router="mlp.router", n_experts_key="num_local_experts", renormalize=True, top_k_first=True),
    sdpa=False,
    vllm=VllmLayout(layers="model.layers", final_norm="model.norm", attention="attn.attn", o_proj="attn.o_proj",
                    attn_out="attn", mlp_out="mlp", mid_norm="post_attention_layernorm", router="mlp.router")),)
