"""interp_engine: mechanistic interpretability of real language models as pure functions over a frozen handle."""

from interp_engine import spec
from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.errors import (BackendError, HarvestError, InputTypeError, InterpEngineError, LoadError,
                                  PointError, ResultTypeError, SpecError)
from interp_engine.func import (Generation, Gradients, LensTop, capture, forward, generate, logit_lens,
                                run_with_cache, run_with_grad, steer)
from interp_engine.handle import ModelHandle
from interp_engine.harvest import Harvest, harvest, load_harvest
from interp_engine.loading import BackendSelection, load_model, select_backend, vllm_installed
from interp_engine.sae import SAE
from interp_engine.sae_files import load_sae
from interp_engine.spec import Spec
from interp_engine.warnings import BackendFallbackWarning, InterpEngineWarning

__version__ = "0.1.0"

__all__ = [
    "Address", "Cache", "ModelHandle", "Spec", "spec", "load_model", "select_backend", "vllm_installed",
    "BackendSelection", "capture", "run_with_cache", "forward", "steer", "generate", "logit_lens", "run_with_grad",
    "Generation", "Gradients", "LensTop",
    "harvest", "load_harvest", "Harvest", "SAE", "load_sae",
    "InterpEngineError", "PointError", "SpecError", "BackendError", "LoadError", "HarvestError", "InputTypeError",
    "ResultTypeError",
    "InterpEngineWarning", "BackendFallbackWarning", "__version__",
]
