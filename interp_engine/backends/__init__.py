"""The backends and what each serves, by name. Nothing here imports vLLM or loads a model.

`REGISTRY` answers questions that come before loading (selection, sizing, quantization); a loaded handle answers
with its own `model.capabilities`. `loader(name)` is the backend's load function, imported when called.
"""

from collections.abc import Callable
from types import MappingProxyType

from interp_engine.backends.base import Capabilities, GradientRuntime, Runtime
from interp_engine.backends.eager.capabilities import EAGER
from interp_engine.backends.vllm.capabilities import VLLM, VLLM_GENERATE, VLLM_STATIC

__all__ = ["Capabilities", "GradientRuntime", "REGISTRY", "Runtime", "capabilities", "loader", "serving"]

REGISTRY: MappingProxyType[str, Capabilities] = MappingProxyType(
    {c.backend: c for c in (EAGER, VLLM, VLLM_STATIC, VLLM_GENERATE)})


def capabilities(backend: str) -> Capabilities:
    """The backend's value before loading (a handle's own may be narrower: `model.capabilities`)."""
    return REGISTRY[backend]


def serving(verb: str) -> tuple[str, ...]:
    """The backends that serve `verb`, in registry order."""
    return tuple(name for name, value in REGISTRY.items() if value.serves(verb))


def loader(backend: str) -> Callable:
    """The backend's `load(repo_id, source, config, selection, hardware, **keywords)`, imported when asked for
    (named imports, never a module name from data)."""
    if REGISTRY[backend].vllm_engine:
        from interp_engine.backends.vllm.load import load
    else:
        from interp_engine.backends.eager.load import load
    return load
