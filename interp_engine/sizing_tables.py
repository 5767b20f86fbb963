"""The sizer's data: GPU memory, per-scheme weight bytes, and each family's parameter layout (see sizing.py)."""

from dataclasses import dataclass

from interp_engine.arch import aliases

GiB = 2**30
# CUDA context and cuBLAS/NCCL workspaces (0.5-1 GiB, outside PyTorch but inside vLLM's budget) plus the activation
# peak of one step that vLLM reserves after its profile run (about 1 GiB for a 16k-token step of an 8B-70B model).
OVERHEAD_BYTES = 2 * GiB
# Total memory in MiB as nvidia-smi and torch.cuda.mem_get_info report it: what gpu_memory_utilization multiplies.
GPUS_MIB: dict[str, int] = {
    "H200-141GB": 143771, "H100-80GB": 81559, "H100-94GB": 95830, "A100-80GB": 81920, "A100-40GB": 40960,
    "L40S-48GB": 46068, "L40-48GB": 46068, "A40-48GB": 46068, "RTXA6000-48GB": 49140, "RTX6000Ada-48GB": 49140,
    "V100-32GB": 32768, "V100-16GB": 16384, "RTX4090-24GB": 24564, "RTX3090-24GB": 24576, "L4-24GB": 23034,
    "A10-24GB": 23028, "T4-16GB": 15360,
}


def tokens_per_step(gpu: str) -> int:
    """vLLM's default max_num_batched_tokens for the LLM class: 16384 on cards of 70 GiB or more but A100s, else 8192.

    It is the most rows one step can carry, so it sizes vllm-static's capture buffers."""
    return 16384 if GPUS_MIB[gpu] * 2**20 >= 70 * GiB and not gpu.startswith("A100") else 8192


@dataclass(frozen=True, slots=True)
class Scheme:
    """Bytes of a block linear layer's weight matrix under one quantization scheme, scales included."""

    per_param: float
    per_matrix: int = 0  # scale bytes per weight matrix
    per_row: int = 0  # scale bytes per output row
    blocks: tuple[tuple[int, int], ...] = ()  # (params per block, scale bytes per block), one pair per level
    experts_only: bool = False  # narrows the routed experts only (the rest stays at the model dtype)


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme(1, per_matrix=4),  # vLLM's fp8_per_tensor: one fp32 scale per matrix
    # NF4 with double quantization (what both backends apply): an 8-bit absmax per 64 params, and an fp32 absmax
    # of those per 256 blocks; the nested constants (under 1 KiB per matrix) are left out.
    "bnb-4bit": Scheme(0.5, blocks=((64, 1), (64 * 256, 4))),
    "bnb-8bit": Scheme(1, per_row=4),  # LLM.int8(): one fp32 scale per output row
}


# `where` names the layers a parameter exists in: "all", or a kind `sizing_shapes.layer_kinds` gives a layer
# ("dense"/"moe" MLPs, "attention"/"linear_attention" mixers, "q_lora"/"no_q_lora" for MLA's query path).
@dataclass(frozen=True, slots=True)
class Linear:
    d_in: str
    d_out: str
    bias: bool | str = False  # a bool, or the config flag that decides it
    where: str = "all"
    times: str | None = None  # "n_experts": one matrix per routed expert, of which top-k run per token
    replicated: bool = False  # every vLLM tensor-parallel rank holds it whole (routers, MLA's down-projections)


@dataclass(frozen=True, slots=True)
class Norm:
    width: str = "d_model"
    bias: bool = False  # LayerNorm has one, RMSNorm does not
    when: str | None = None  # the config flag the norm exists under
    where: str = "all"


@dataclass(frozen=True, slots=True)
class Layout:
    """One decoder layer's parameters, then what sits outside the layers."""

    linears: tuple[Linear, ...]
    norms: tuple[Norm, ...]
    final_norm: Norm
    lm_head_bias: bool = False
    learned_positions: bool = False
    # per token: "heads" (K and V per KV head), "latent" (MLA's compressed KV + rope key), or "own" (K and V of the
    # layers that compute their own, at each layer's width: Gemma 4's KV-shared layers cache nothing)
    cache: str = "heads"
    outside: tuple[tuple[str, str], ...] = ()  # more (rows, columns) parameters outside the layers (Gemma 4's PLE)
    d_mlp_keys: tuple[str, ...] = ("intermediate_size",)  # for the families that have no arch table


def _attention(qkv_bias: bool | str, o_bias: bool | str) -> tuple[Linear, ...]:
    return (Linear("d_model", "q", qkv_bias), Linear("d_model", "kv", qkv_bias), Linear("d_model", "kv", qkv_bias),
            Linear("q", "d_model", o_bias))


def _mlp(bias: bool | str, *, gated: bool) -> tuple[Linear, ...]:
    return (Linear("d_model", "d_mlp", bias),) * (1 + gated) + (Linear("d_mlp", "d_model", bias),)


_RMS, _LN, _FUSED = Norm(), Norm(bias=True), (Linear("d_model", "qkv", True), Linear("d_model", "d_model", True))
LAYOUTS: dict[str, Layout] = {
    "llama": Layout(_attention("attention_bias", "attention_bias") + _mlp("mlp_bias", gated=True), (_RMS,) * 2, _RMS),
    "mistral": Layout(_attention(False, False) + _mlp(False, gated=True), (_RMS,) * 2, _RMS),
    "qwen2": Layout(_attention(True, False) + _mlp(False, gated=True), (_RMS,) * 2, _RMS),
    "qwen3": Layout(_attention("attention_bias", "attention_bias") + _mlp(False, gated=True),
                    (_RMS, _RMS, Norm("d_head"), Norm("d_head")), _RMS),
    "gemma2": Layout(_attention("attention_bias", "attention_bias") + _mlp(False, gated=True), (_RMS,) * 4, _RMS),
    "gpt2": Layout(_FUSED + _mlp(True, gated=False), (_LN,) * 2, _LN, learned_positions=True),
    "gpt_neox": Layout((Linear("d_model", "qkv", "attention_bias"), Linear("d_model", "d_model", "attention_bias"))
                       + _mlp(True, gated=False), (_LN,) * 2, _LN),
    "phi": Layout(_attention(True, True) + _mlp(True, gated=False), (_LN,) + (Norm("head", True, "qk_layernorm"),) * 2,
                  _LN, lm_head_bias=True),
    "gemma3_text": Layout(_attention("attention_bias", "attention_bias") + _mlp(False, gated=True),
                          (_RMS,) * 4 + (Norm("d_head"),) * 2, _RMS),
    "olmo2": Layout(_attention("attention_bias", "attention_bias") + _mlp(False, gated=True),
                    (_RMS, _RMS, Norm("q"), Norm("kv")), _RMS),
    # Fused projections: one q+k+v matrix and one gate+up matrix, as the checkpoint (and vLLM) holds them.
    "phi3": Layout((Linear("d_model", "q_kv"), Linear("q", "d_model"), Linear("d_model", "2d_mlp"),
                    Linear("d_mlp", "d_model")), (_RMS,) * 2, _RMS),
}


def _gated(d_mlp: str, *, where: str = "all", times: str | None = None) -> tuple[Linear, ...]:
    return (Linear("d_model", d_mlp, where=where, times=times),) * 2 + (Linear(d_mlp, "d_model", where=where, times=times),)


# MoE: a replicated router, routed experts, and (DeepSeek, Qwen3-Next) shared experts that every token runs.
_SPARSE = (Linear("d_model", "n_experts", where="moe", replicated=True),) + _gated("d_expert", where="moe",
                                                                                  times="n_experts")
_MLA = (Linear("d_model", "q_lora", where="q_lora", replicated=True), Linear("q_lora", "q_mla", where="q_lora"),
        Linear("d_model", "q_mla", where="no_q_lora"), Linear("d_model", "kv_a", replicated=True),
        Linear("kv_lora", "kv_b"), Linear("o_mla", "d_model"))
# Gated attention (q_proj also emits an output gate) and Gated DeltaNet, as Qwen3-Next and Qwen3.5 hold them.
_GATED_ATTENTION = (Linear("d_model", "2q", where="attention"), Linear("d_model", "kv", where="attention"),
                    Linear("d_model", "kv", where="attention"), Linear("q", "d_model", where="attention"))
_DELTA_NORMS = (Norm("d_head", where="attention"),) * 2 + (Norm("lv_heads", where="linear_attention"),) * 2 \
    + (Norm("lv_dim", where="linear_attention"),)
_DELTA_CONV_OUT = (Linear("kernel", "lin_conv", where="linear_attention"),
                   Linear("value_dim", "d_model", where="linear_attention"))
LAYOUTS.update({
    # Every layer sparse (published checkpoints): a replicated router and the routed experts, no shared expert.
    "qwen3_moe": Layout(_attention("attention_bias", "attention_bias") + _SPARSE,
                        (_RMS, _RMS, Norm("d_head"), Norm("d_head")), _RMS),
    "mixtral": Layout(_attention(False, False) + _SPARSE, (_RMS,) * 2, _RMS),
    "deepseek_v3": Layout(_MLA + _gated("d_mlp", where="dense")
                          + _SPARSE + _gated("d_shared", where="moe"),
                          (_RMS, _RMS, Norm("q_lora", where="q_lora"), Norm("kv_lora")),
                          _RMS, cache="latent"),
    "qwen3_next": Layout(_GATED_ATTENTION + (Linear("d_model", "lin_qkvz", where="linear_attention"),
                                             Linear("d_model", "lin_ba", where="linear_attention")) + _DELTA_CONV_OUT
                         + _gated("d_mlp", where="dense") + _SPARSE + _gated("d_shared", where="moe")
                         + (Linear("d_model", "one", where="moe", replicated=True),),
                         (_RMS, _RMS) + _DELTA_NORMS, _RMS),
    "qwen3_5_text": Layout(_GATED_ATTENTION + tuple(Linear("d_model", w, where="linear_attention") for w in
                                                    ("lin_qkv", "value_dim", "lv_heads", "lv_heads"))
                           + _DELTA_CONV_OUT + _gated("d_mlp"), (_RMS, _RMS) + _DELTA_NORMS, _RMS),
    # Qwen3.5's layers with Qwen3-Next's experts: routed, a gated shared expert and its one-logit gate.
    "qwen3_5_moe_text": Layout(_GATED_ATTENTION + tuple(Linear("d_model", w, where="linear_attention") for w in
                                                        ("lin_qkv", "value_dim", "lv_heads", "lv_heads"))
                               + _DELTA_CONV_OUT + _SPARSE + _gated("d_shared", where="moe")
                               + (Linear("d_model", "one", where="moe", replicated=True),),
                               (_RMS, _RMS) + _DELTA_NORMS, _RMS),
    # Attention sinks (one logit per head) sit with the norms: a vector per layer.
    "gpt_oss": Layout(_attention(True, True) + (Linear("d_model", "n_experts", True, replicated=True),
                                                Linear("d_model", "2d_expert", True, times="n_experts"),
                                                Linear("d_expert", "d_model", True, times="n_experts")),
                      (_RMS, _RMS, Norm("n_heads")), _RMS, d_mlp_keys=("intermediate_size",)),
})
# Gemma 4 (text): sliding ("local") and full ("global") layers of their own head width; k and v only where a layer
# computes its own (not the last num_kv_shared_layers), a global layer's v only without attention_k_eq_v; q/k norms
# per head (v's norm has no weight); the double-wide MLP of a KV-shared layer; per-layer inputs: a gate and a
# projection and a norm per layer, and outside the layers their packed embedding, projection from the token
# embedding and norm. The MoE block (26B-A4B, "moe" layers): a replicated router with a d_model scale and a
# per-expert scale, the routed experts (gate_up fused: the same parameters), and three more norms.
_GEMMA4_PLE = (Linear("d_model", "ple"), Linear("ple", "d_model"))
LAYOUTS["gemma4_text"] = Layout(
    (Linear("d_model", "q", where="local"), Linear("d_model", "q_global", where="global"),
     Linear("d_model", "kv", where="kv_own_local"), Linear("d_model", "kv", where="kv_own_local"),
     Linear("d_model", "kv_global", where="kv_own_global"), Linear("d_model", "kv_global", where="global_v"),
     Linear("q", "d_model", where="local"), Linear("q_global", "d_model", where="global"))
    + _gated("d_mlp", where="narrow") + _gated("2d_mlp", where="wide") + _GEMMA4_PLE + _SPARSE,
    (_RMS,) * 4 + (Norm(when="hidden_size_per_layer_input"), Norm("d_head", where="local"), Norm("d_head_global", where="global"),
                   Norm("d_head", where="kv_own_local"), Norm("d_head_global", where="kv_own_global"))
    + (Norm(where="moe"),) * 4 + (Norm("n_experts", where="moe"),),
    _RMS, cache="own", outside=(("vocab_ple", "ple_all"), ("d_model", "ple_all"), ("one", "ple")))
# Multimodal checkpoints whose config.json wraps the text model the sizer prices (the vision tower is left out):
# the ones load_model serves as their text model.
WRAPPERS = tuple(aliases.WRAPPERS)
# Model types that are another family's shape under a new name: arch/aliases.ALIASES, which load_model reads too.
