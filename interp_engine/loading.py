"""load_model: one entry point, a repo id or folder, and a backend. Construction is lazy on every backend.

Everything a call can get wrong is refused before any weight is read: here what every backend shares (the
backend, the counts, the checkpoint and the scheme's name), then in the chosen backend's own `load` (found through
`interp_engine.backends.loader`) the keywords and where they belong, the scheme and KV cache dtype for that
backend, and the device count.
"""

import dataclasses
import warnings
from typing import Any

from interp_engine import backends
from interp_engine import quantization as Q
from interp_engine.errors import InputTypeError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.hub import HubSource
from interp_engine.load_guards import check_fits
from interp_engine.selection import (BackendSelection, Hardware, check_backend, choose_backend, read_config,
                                     select_backend, vllm_installed)
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
    revision: str | None = None,
    cache_dir: str | None = None,
    token: str | bool | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> ModelHandle:
    """A lazy handle on `repo_id` (a checkpoint folder, or a HF repo id).

    A repo id not in the local HF cache is downloaded first (`revision=`, `cache_dir=`, `token=`; a progress bar
    on a terminal unless `progress=False`; `HF_HUB_OFFLINE=1` refuses), and every backend loads the snapshot
    folder. Nothing else heavy happens here: `await model.warmup()` (or the first call that needs the weights) loads.
    Keywords not named here go verbatim to `from_pretrained` on eager; on vLLM, engine arguments go through
    `extra_vllm_kwargs`. `num_gpus` is never inferred: it is 1 unless given.
    """
    backend = check_backend(backend)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise SpecError(fix(f"num_gpus={num_gpus!r}: it counts GPUs to shard over, at least 1.",
                            "leave it at 1, or give the number of GPUs to shard over."))
    if not isinstance(requires_grad, bool):
        raise InputTypeError(fix(f"requires_grad must be True or False, got {requires_grad!r}.", "pass requires_grad=True."))
    source, config = read_config(repo_id, HubSource(revision, cache_dir, token, progress))
    Q.check_shipped(config, quantization, str(repo_id))
    Q.check_scheme(quantization)
    Q.check_kv_cache_dtype(kv_cache_dtype)
    hardware = Hardware.probe()
    selection = choose_backend(config, source, requested_device=device, requested_dtype=dtype, force_backend=backend,
                               vllm_available=vllm_installed(), hardware=hardware,
                               eager_only=_eager_only(requires_grad, attn_implementation, quantization))
    check_fits(str(repo_id), config, selection, quantization=quantization, num_gpus=num_gpus)
    if backend == "auto" and not selection.use_vllm:
        warnings.warn(f"load_model({str(repo_id)!r}): {selection.reason}.", BackendFallbackWarning, stacklevel=2)
    handle = backends.loader(selection.backend)(
        repo_id, source, config, selection, hardware, attn_implementation=attn_implementation,
        requires_grad=requires_grad, quantization=quantization, kv_cache_dtype=kv_cache_dtype, num_gpus=num_gpus,
        static_points=static_points, static_writes=static_writes, gpu_memory_utilization=gpu_memory_utilization,
        max_model_len=max_model_len, extra_vllm_kwargs=extra_vllm_kwargs, kwargs=kwargs)
    # The backend chosen here, so that every replica elsewhere runs the same one.
    call = dict(repo_id=str(repo_id), backend=handle.backend, device=device, dtype=dtype,
                attn_implementation=attn_implementation, requires_grad=requires_grad, quantization=quantization,
                kv_cache_dtype=kv_cache_dtype, num_gpus=num_gpus, static_points=static_points,
                static_writes=static_writes, gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len, extra_vllm_kwargs=extra_vllm_kwargs, **kwargs)
    return dataclasses.replace(handle, load_call=tuple(call.items()))


def _eager_only(requires_grad: bool, attn_implementation: str | None, quantization: str | None) -> str | None:
    """Why backend="auto" must take eager whatever the machine: a keyword only eager serves."""
    if requires_grad:
        return "requires_grad=True: gradients through the forward are eager-only"
    if attn_implementation is not None:
        return "attn_implementation= chooses HF attention, which only the eager backend runs"
    return Q.eager_only_reason(quantization)
