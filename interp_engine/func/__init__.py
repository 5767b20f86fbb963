"""The pure functions: (handle, tokens, spec) in, shape-typed tensors out. The model is never changed."""

from interp_engine.func.capture import capture
from interp_engine.func.generate import Generation, generate
from interp_engine.func.grad import Gradients, run_with_grad
from interp_engine.func.lens import logit_lens
from interp_engine.func.steer import steer

__all__ = ["capture", "steer", "generate", "logit_lens", "run_with_grad", "Generation", "Gradients"]
