"""The sizer's data: GPU memory, per-scheme weight bytes, and each family's parameter layout (see sizing.py)."""

from dataclasses import dataclass

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


SCHEMES: dict[str, Scheme] = {
    "fp8": Scheme(1, per_matrix=4),  # vLLM's fp8_per_tensor: one fp32 scale per matrix
    # NF4 with double quantization (what both backends apply): an 8-bit absmax per 64 params, and an fp32 absmax
    # of those per 256 blocks; the nested constants (under 1 KiB per matrix) are left out.
    "bnb-4bit": Scheme(0.5, blocks=((64, 1), (64 * 256, 4))),
    "bnb-8bit": Scheme(1, per_row=4),  # LLM.int8(): one fp32 scale per output row
}


@dataclass(frozen=True, slots=True)
class Linear:
    d_in: str
    d_out: str
    bias: bool | str = False  # a bool, or the config flag that decides it


@dataclass(frozen=True, slots=True)
class Norm:
    width: str = "d_model"
    bias: bool = False  # LayerNorm has one, RMSNorm does not
    when: str | None = None  # the config flag the norm exists under


@dataclass(frozen=True, slots=True)
class Layout:
    """One decoder layer's parameters, then what sits outside the layers."""

    linears: tuple[Linear, ...]
    norms: tuple[Norm, ...]
    final_norm: Norm
    lm_head_bias: bool = False
    learned_positions: bool = False


def _attention(qkv_bias: bool | str, o_bias: bool | str) -> tuple[Linear, ...]:
    return (Linear("d_model", "q", qkv_bias), Linear("d_model", "kv", qkv_bias), Linear("d_model", "kv", qkv_bias),
            Linear("q", "d_model", o_bias))


def _mlp(bias: bool | str, *, gated: bool) -> tuple[Linear, ...]:
    return (Linear("d_model", "d_mlp", bias),) * (1 + gated) + (Linear("d_mlp", "d_model", bias),)


# A sparse MLP: the router, then every expert's fused gate+up and down matrices, each kind stacked in one tensor
# (as HF and vLLM hold them; a scheme's per-matrix scales are priced per stack, not per expert).
_EXPERTS = (Linear("d_model", "n_experts"), Linear("d_model", "experts_2d_mlp"), Linear("experts_d_mlp", "d_model"))
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
    "qwen3_moe": Layout(_attention("attention_bias", "attention_bias") + _EXPERTS,
                        (_RMS, _RMS, Norm("d_head"), Norm("d_head")), _RMS),
    "mixtral": Layout(_attention(False, False) + _EXPERTS, (_RMS,) * 2, _RMS),
}
