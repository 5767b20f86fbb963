"""Gemma 4 (text: `gemma4_text`; the multimodal `gemma4` wrapper served as it, arch/aliases.py): Gemma 3's
four norms per layer (RMS norms scaled by their weight, not 1 + weight), q/k RMS norms per head and a scale-free v
norm, embeddings scaled by sqrt(d_model) inside the embedding module (`embed` is the scaled one), sliding and
global layers as `layer_types` says, plus:

- Per-layer head widths. A global (full-attention) layer's heads are `global_head_dim` wide and, with
  `attention_k_eq_v`, it has `num_global_key_value_heads` KV heads whose v is its k before the norms (no
  v_proj); sliding layers have `head_dim` and `num_key_value_heads`. `Dims.layer_sizes` holds each layer's own
  (read from the config's `per_layer_config`); q/k/v/z at a layer have that layer's width, and a vector of
  another width is refused naming it. `model.d_head` / `model.cfg.d_head` are the sliding layers' width.
- KV-shared layers (the last `num_kv_shared_layers`) compute no k or v: each attends over the keys and values of
  the last earlier layer of its own type. k and v are refused there (the `kv_shared` layer kind), naming the
  layers that have them. A write to k or v at the layer whose keys are shared reaches the sharing layers too (they
  attend over the same keys, as in vLLM's shared KV cache); q, z, patterns and attn_out are the layer's own.
- Double-wide MLP (`use_double_wide_mlp`): a KV-shared layer's MLP is twice `intermediate_size`; mlp_act,
  mlp_pre and mlp_pre_linear have that layer's width (`Dims.layer_sizes`).
- Per-layer inputs (`hidden_size_per_layer_input`): after the MLP's residual add, each layer adds a gated,
  projected and normed per-layer embedding, computed once from the token embedding before layer 0 (so an edit at
  `embed` changes the residual stream, not the per-layer inputs), then multiplies the stream by its
  `layer_scalar`. That term has no point of its own: resid_post = (resid_mid + mlp_out + per-layer term) *
  layer_scalar; read resid_post minus resid_mid minus mlp_out (with layer_scalar 1) to get it.
  `resid_mid` is written by shifting attn_out (`Arch.mlp_tail`), since the block does more than add the MLP's
  output to it.
- The MoE block (`enable_moe_block`, the 26B-A4B checkpoint): in every layer, experts beside the dense MLP. The
  router (`router`) reads resid_mid itself (a scale-free RMS norm, times its `scale` and 1/sqrt(d_model)) and
  its `proj` makes the logits (`router_logits`, hooked there: HF's router then chooses from what the hook
  returns, as it would from its own); softmax, top k, renormalised, times `per_expert_scale` of the chosen
  experts (`expert_weights`). The experts read `pre_feedforward_layernorm_2(resid_mid)`; `expert_out` is each
  chosen expert's output before the weighted sum. mlp_out is post_feedforward_layernorm's output:
  post_feedforward_layernorm(post_feedforward_layernorm_1(dense MLP) + post_feedforward_layernorm_2(experts)).
  The dense MLP keeps its points (mlp_pre, mlp_pre_linear, mlp_act). A dense config has no experts
  (`Moe.enabled_key`: `table_for` drops them). vLLM 0.32 builds the block where `num_experts` is set instead: a
  config where the two disagree is refused on the vLLM backends (`moe_switch_problem`).

TransformerLens-shaped weights are not served: the layers' head widths differ and KV-shared layers have no k or v
projections. attn_result is each head's z times its rows of the layer's own o_proj (`Arch.o_proj`), before the
post-attention norm, as on Gemma 2/3. Served on every backend with every point (`VLLM` below for both vLLM ones;
their buffers and gathers follow each layer's own widths: `Shards.layers`).
"""

import dataclasses

from interp_engine.arch import VllmLayout, gemma2
from interp_engine.arch.routing import Moe

# Where the points sit in vLLM 0.32's gemma4.py (Gemma4ForCausalLM), checked against its module tree in
# tests/test_gemma4.py. Its layers take (positions, hidden, None, per_layer_input) and return (stream, None)
# ("first"); the norms are plain, each output added by the layer itself (no fused add-norm), so resid_mid is the
# input of `pre_feedforward_layernorm`, which is also the tensor the layer adds the MLP's output to (written in
# place: sites.STREAM_SHARED); a KV-shared layer's Attention is called as (q, None, None), reading its source
# layer's cache, so its patterns are recomputed from that layer's keys (`layers.kv_sources`). The MoE block's
# `router` returns the logits alone, which its experts' custom routing function (softmax, top k, renormalised,
# times per_expert_scale) chooses from; its experts read `pre_feedforward_layernorm_2` of the router's input
# (resid_mid), which expert_out's recomputation applies to the router's input rows (`experts_norm`).
VLLM = VllmLayout(layers="model.layers", final_norm="model.norm", attention="self_attn.attn", o_proj="self_attn.o_proj",
                  attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm", mlp_down="mlp.down_proj",
                  mlp_in="mlp.gate_up_proj", mid_norm="pre_feedforward_layernorm", stream_out="first",
                  router="router", experts_norm="pre_feedforward_layernorm_2")

ARCHES = (dataclasses.replace(
    gemma2.ARCHES[0], family="gemma4", model_types=("gemma4_text",), vllm=VLLM, normalization="rmsnorm",
    kv_shared_key="num_kv_shared_layers", kv_shares="shared_kv_states", double_wide_key="use_double_wide_mlp",
    mlp_tail=True,
    weights_refusal="a model whose layers differ in head width and whose KV-shared layers have no k or v "
                    "projections",
    o_proj="self_attn.o_proj",
    moe=Moe(router="router.proj", n_experts_key="num_experts", top_k_key="top_k_experts", renormalize=True,
            experts="experts", enabled_key="enable_moe_block", dense_mlp=True,
            expert_scale="router.per_expert_scale"),
),)


def moe_switch_problem(config) -> str | None:
    """Why eager and vLLM would run different models from this Gemma 4 config, or None: HF builds the MoE block
    where `enable_moe_block` is true, vLLM 0.32 where `num_experts` is set. (The block enabled without
    num_experts is refused on every backend: `read_dims`.)"""
    if getattr(config, "model_type", None) != "gemma4_text" or getattr(config, "enable_moe_block", False):
        return None
    experts = getattr(config, "num_experts", None)
    return None if experts is None else (f"num_experts={experts} and enable_moe_block is false: vLLM 0.32 builds "
                                         "Gemma 4's MoE block from num_experts, HF does not")
