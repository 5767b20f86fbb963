"""What the three vLLM backends serve. Plain data: importing this never imports vLLM, so the registry can ask
before loading (and on an eager-only install)."""

import dataclasses

from interp_engine.backends.base import Capabilities
from interp_engine.taps import Taps

# Shared by the three: a vLLM engine narrows with its own kernels, and continuous batching splits a call's batch
# across steps (no batch mean), in worker processes (no Python functions), with inference kernels (no gradients).
_ENGINE = dict(mean_ablation=False, custom_ops=False, gradients=False, quantization=frozenset({"fp8", "bnb-4bit"}),
               vllm_engine=True)

VLLM = Capabilities(
    backend="vllm", verbs=frozenset({"capture", "steer", "generate", "logit_lens"}), points=True, patterns=True,
    eager_only_writes=False, declares_taps=False, **_ENGINE,
    fixed_engine_args=("enforce_eager", "worker_extension_cls", "worker_cls"),
    fixed_because="its hooks need an uncompiled model (enforce_eager=True) and interp_engine's worker extension",
    fixed_instead='; backend="vllm-generate" runs a plain engine',
)
VLLM_STATIC = Capabilities(
    backend="vllm-static", verbs=frozenset({"capture", "steer", "generate", "logit_lens"}), points=True,
    patterns=True, eager_only_writes=False, declares_taps=True, feature_edits=False, **_ENGINE,
    fixed_engine_args=("worker_extension_cls", "worker_cls"),
    fixed_because="its taps are installed by interp_engine's worker class",
)
VLLM_GENERATE = Capabilities(
    backend="vllm-generate", verbs=frozenset({"generate"}), points=False, patterns=False, eager_only_writes=False,
    declares_taps=False, **_ENGINE,
)
BACKENDS = (VLLM, VLLM_STATIC, VLLM_GENERATE)


def for_handle(backend: str, taps: Taps | None, layout=None) -> Capabilities:
    """A handle's value: on vllm-static, the taps it was compiled with; with the points the family's vLLM layout
    reads only (`VllmLayout.read_only`)."""
    value = next(c for c in BACKENDS if c.backend == backend)
    if value.declares_taps:
        value = dataclasses.replace(value, taps=taps)
    if layout is not None and layout.read_only and value.points:
        value = dataclasses.replace(value, read_only=frozenset(layout.read_only), read_only_why=layout.read_only_why)
    return value
