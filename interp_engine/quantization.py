"""Which quantization scheme each backend can apply on load, and the refusal that names the alternative."""

import difflib
import importlib.util
from typing import Any

from interp_engine.errors import BackendError, SpecError, fix

VLLM_BACKENDS = ("vllm", "vllm-static", "vllm-generate")
SCHEMES: dict[str, tuple[str, ...]] = {
    "fp8": VLLM_BACKENDS,
    "bnb-4bit": ("eager",),
    "bnb-8bit": ("eager",),
}
_ALTERNATIVE = {
    "fp8": 'use a vLLM backend (backend="vllm"), or a repo that ships in FP8',
    "bnb-4bit": 'use backend="eager" for bnb-4bit',
    "bnb-8bit": 'use backend="eager", or quantization="bnb-4bit"',
}


def check_scheme(scheme: str | None, backend: str) -> None:
    if scheme is None:
        return
    if scheme not in SCHEMES:
        near = difflib.get_close_matches(str(scheme), list(SCHEMES), n=1, cutoff=0.0)
        raise SpecError(fix(f"quantization={scheme!r} is not a scheme interp_engine applies on load.",
                            f"did you mean {near[0]!r}? Schemes: {', '.join(SCHEMES)}."))
    if backend not in SCHEMES[scheme]:
        raise BackendError(fix(f"quantization={scheme!r} cannot be applied on backend={backend!r}.",
                               _ALTERNATIVE[scheme] + "."))


def eager_quantization_config(scheme: str | None, dtype) -> dict[str, Any]:
    """HF keyword arguments that narrow a checkpoint with bitsandbytes as it loads."""
    if scheme is None:
        return {}
    if importlib.util.find_spec("bitsandbytes") is None:
        raise BackendError(fix(f"quantization={scheme!r} needs the bitsandbytes package, which is not installed.",
                               "pip install 'interp_engine[bitsandbytes]' (bitsandbytes needs a CUDA GPU)."))
    from transformers import BitsAndBytesConfig

    if scheme == "bnb-4bit":
        return {"quantization_config": BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=dtype)}
    return {"quantization_config": BitsAndBytesConfig(load_in_8bit=True)}
