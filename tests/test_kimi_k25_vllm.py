"""Kimi-K2.5/K2.6's multimodal wrapper (model_type kimi_k25, KimiK25ForConditionalGeneration) on the vLLM backends,
served as its DeepSeek-V3 text model: vLLM builds that model at `language_model` (arch/aliases.py's
WRAPPERS), where the worker resolves DeepSeek's own layout, and starts with `language_model_only=True` (no
vision tower). The tiny checkpoint is the wrapper's real layout (interp_engine.tiny_wrappers): transformers' own
Kimi_K25Config around the tiny DeepSeek with the real latent (tests/test_deepseek_vllm.py), its text weights under
`language_model.`, a tiny vision tower and projector from transformers' Kimi_K25ForConditionalGeneration beside
them. The reference is eager reading the same folder (tests/test_deepseek.py proves that equal to the unwrapped
DeepSeek and to HF)."""

import pytest

from interp_engine import load_model
from interp_engine.tiny_wrappers import build_wrapper
from tests.skips import requires
from tests.test_deepseek_vllm import REAL_LATENT, _served, check_every_point_and_write_equals_eager


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    return build_wrapper("kimi_k25", tmp_path_factory.mktemp("kimi") / "kimi_k25", overrides=REAL_LATENT)


@pytest.fixture(scope="module")
def reference(kimi_path):
    model = load_model(str(kimi_path), backend="eager", attn_implementation="eager", device="cpu")
    model.runtime.load()
    return model


@requires("vllm")
@requires("slow")  # an engine start each: about 45 s here (vllm-static's compile and two ranks, about 90 s)
@pytest.mark.parametrize("backend, num_gpus", [("vllm", 1), ("vllm-static", 1), ("vllm", 2)])
def test_every_served_point_plain_and_under_writes_equals_eager_reading_the_wrapper(kimi_path, reference, backend,
                                                                                    num_gpus):
    """DeepSeek's every served point at every layer, plain and under its writes (router steering included); at
    num_gpus=2 the wrapper's text model split over two ranks."""
    assert reference.arch.family == "deepseek_v3"
    for model in _served(kimi_path, num_gpus, backend, reference):
        check_every_point_and_write_equals_eager(model, reference)


@requires("vllm")
def test_the_wrapper_loads_on_both_vllm_backends_as_deepseek_before_any_engine_starts(kimi_path, reference):
    """No refusal for the wrapper (the engine starts lazily, at the first call: nothing starts here); the points
    vllm serves are DeepSeek's there, and vllm-static takes DeepSeek's declarations."""
    from tests.test_deepseek_vllm import SERVED, WRITES

    model = load_model(str(kimi_path), backend="vllm", max_model_len=128)
    assert model.arch.family == "deepseek_v3" and model.cfg == reference.cfg
    assert {a.point for a in model.points()} == SERVED
    static = load_model(str(kimi_path), backend="vllm-static", max_model_len=128, static_points=["kv_latent.1"],
                        static_writes=WRITES)
    assert static.arch.family == "deepseek_v3"
