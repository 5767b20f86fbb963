"""The pure functions: (handle, tokens, spec) in, shape-typed tensors out. The model is never changed."""

from interp_engine.func.capture import capture, run_with_cache
from interp_engine.func.generate import Generation, generate
from interp_engine.func.grad import Gradients, run_with_grad
from interp_engine.func.lens import LensTop, logit_lens
from interp_engine.func.steer import forward, steer

__all__ = ["capture", "run_with_cache", "forward", "steer", "generate", "logit_lens", "run_with_grad", "Generation",
           "Gradients", "LensTop"]
