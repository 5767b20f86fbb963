"""load_model's eager half: the refusals only eager makes, then a lazy handle (no weights are read here)."""

import difflib
from typing import Any

import torch

from interp_engine import quantization as Q
from interp_engine.arch import aliases, arch_for, read_cfg, read_dims
from interp_engine.errors import BackendError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.load_guards import load_tokenizer
from interp_engine.selection import BackendSelection, Hardware


def load(repo_id: str, source: str, config, selection: BackendSelection, hardware: Hardware, *,
         attn_implementation: str | None, requires_grad: bool, quantization: str | None, kv_cache_dtype: str | None,
         num_gpus: int, static_points: Any, static_writes: Any, gpu_memory_utilization: float | None,
         max_model_len: int | None, extra_vllm_kwargs: dict[str, Any] | None, kwargs: dict[str, Any]) -> ModelHandle:
    vllm_only = {"kv_cache_dtype": kv_cache_dtype, "static_points": static_points, "static_writes": static_writes,
                 "gpu_memory_utilization": gpu_memory_utilization, "max_model_len": max_model_len,
                 "extra_vllm_kwargs": extra_vllm_kwargs}
    for name, value in vllm_only.items():
        if value is not None:
            where = 'backend="vllm-static"' if name.startswith("static") else 'a vLLM backend (backend="vllm")'
            raise BackendError(fix(f"{name}= is a vLLM setting; the eager backend has no such knob.",
                                   f"drop {name}= for eager, or use {where}."))
    Q.check_scheme(quantization, "eager")
    Q.check_installed(quantization, "eager")
    if num_gpus > 1 and torch.cuda.device_count() < num_gpus:
        raise SpecError(fix(f"num_gpus={num_gpus} but {torch.cuda.device_count()} CUDA devices are visible.",
                            "lower num_gpus, or set CUDA_VISIBLE_DEVICES to expose more cards."))
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from interp_engine.backends.eager.runtime import EagerRuntime

    arch = arch_for(config, name=str(repo_id))
    impl = attn_implementation or ("sdpa" if arch.sdpa else "eager")
    if impl == "sdpa" and not arch.sdpa:
        raise SpecError(fix(f"HF's {arch.family} has no SDPA attention (its sinks need the eager softmax).",
                            "drop attn_implementation= (eager is this family's default) or pass \"eager\"."))
    if impl != "eager" and impl not in ALL_ATTENTION_FUNCTIONS:
        near = difflib.get_close_matches(impl, ["eager", *ALL_ATTENTION_FUNCTIONS], n=1, cutoff=0.0)
        raise SpecError(fix(f"attn_implementation={impl!r} is not an attention implementation transformers knows.",
                            f"did you mean {near[0]!r}? attn_implementation=\"eager\" makes attn_probs readable."))
    aliased = aliases.hf_kwargs(source, config)  # Kimi-K2's config.json: read here, never by transformers
    tokenizer = load_tokenizer(source, trust_remote_code=kwargs.get("trust_remote_code") is True, name=str(repo_id),
                               config=aliased.get("config"))
    narrowing = Q.eager_quantization_kwargs(quantization, selection.dtype, selection.device, num_gpus)
    runtime = EagerRuntime(
        source=source, arch=arch, dims=read_dims(config, arch), device=selection.device, dtype=selection.dtype,
        attn_implementation=impl, num_gpus=num_gpus, hf_kwargs={**narrowing, **aliased, **kwargs}, tokenizer=tokenizer,
    )
    return ModelHandle(name=str(repo_id), backend="eager", device=selection.device, dtype=selection.dtype,
                       attn_implementation=impl, requires_grad=requires_grad, arch=arch,
                       dims=runtime.dims, cfg=read_cfg(config, arch, runtime.dims), runtime=runtime)
