"""What the eager backend serves: every verb and every point, HF's own tensors included. Plain data (no torch
model, no transformers import), so the registry can ask before loading."""

import dataclasses

from interp_engine.backends.base import VERBS, Capabilities

EAGER = Capabilities(
    backend="eager", verbs=frozenset(VERBS), points=True,
    # Attention patterns exist only where HF's eager attention forms them: a handle says which it runs.
    patterns=True, eager_only_writes=True,
    # One call is one batched forward in this process: the batch mean is defined and Python functions run here.
    mean_ablation=True, custom_ops=True, gradients=True,
    quantization=frozenset({"bnb-4bit", "bnb-8bit"}), vllm_engine=False, declares_taps=False, eager_only_reads=True,
)


def for_handle(attn_implementation: str) -> Capabilities:
    """A handle's value: attn_scores and attn_probs are readable only under attn_implementation="eager"."""
    return dataclasses.replace(EAGER, attn_implementation=attn_implementation,
                               patterns=attn_implementation == "eager")
