"""Bad requests and loads on backend="vllm" (one engine, the tiny Llama at max_model_len=64): refused before the engine
is given any request or keeps any table, and before another engine starts; the engine serves on."""

import pytest
import torch

from interp_engine import capture, generate, load_model, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError, InputTypeError, PointError, SpecError
from tests.refusals import PROMPT, assert_refused_on_vllm
from tests.skips import requires


VLLM_REQUESTS = [
    pytest.param(lambda m: capture(m, [[1] * 64], ["resid_post.0"]), SpecError,
                 ("64 tokens; the model takes at most 63", "truncate it to 63 tokens"), id="prompt-past-max_model_len"),
    pytest.param(lambda m: generate(m, [[1] * 60], max_new_tokens=8), SpecError,
                 ("plus 8 new ones exceeds the model's 63 positions",), id="generate-past-max_model_len"),
    pytest.param(lambda m: capture(m, [[1, 2, 512]], ["resid_post.0"]), SpecError,
                 ("outside the vocabulary (0..511)", "[512]"), id="token-past-vocab"),
    pytest.param(lambda m: steer(m, PROMPT, S.Add("resid_post.0", torch.full((128,), float("nan")))), SpecError,
                 ("NaN",), id="nan-vector"),
    pytest.param(lambda m: steer(m, PROMPT, S.Add("resid_post.0", torch.randn(64))), SpecError,
                 ("vector has shape (64,)", "(128,)"), id="vector-shape"),
    pytest.param(lambda m: steer(m, PROMPT, S.Custom("resid_post.0", lambda x: x)), BackendError,
                 ("never crosses into a vLLM worker", 'backend="eager"'), id="custom-op"),
    pytest.param(lambda m: steer(m, PROMPT, S.Ablate("z.0", how="mean")), BackendError,
                 ("depend on scheduling", "S.Set("), id="mean-ablation"),
    pytest.param(lambda m: steer(m, PROMPT, S.Scale("attn_probs.0", 0.5)), BackendError,
                 ("only on the eager backend",), id="write-attn-probs"),
    pytest.param(lambda m: steer(m, PROMPT, S.Set("logits", torch.zeros(512))), BackendError,
                 ("only on the eager backend",), id="write-logits"),
    pytest.param(lambda m: run_with_grad(m, PROMPT, loss=lambda lg: lg.sum(), wrt=["resid_post.0"]), BackendError,
                 ('backend="eager", requires_grad=True',), id="gradients"),
    pytest.param(lambda m: capture(m, PROMPT, ["resid_post.3"]), PointError, ("3 layers (0..2)",),
                 id="layer-out-of-range"),
    pytest.param(lambda m: steer(m, PROMPT, S.Ablate("k.0", heads=[2])), PointError, ("k has 2 heads",),
                 id="kv-head-out-of-range"),
    pytest.param(lambda m: capture(m, PROMPT, ["resid_post.0"], sepc=None), InputTypeError,
                 ("did you mean 'spec'?",), id="unknown-keyword"),
    pytest.param(lambda m: logit_lens(m, PROMPT, points=["mlp_act.0"]), SpecError, ("not d_model-shaped",),
                 id="lens-not-residual"),
]


@requires("vllm")
@pytest.mark.parametrize("call, error, fragments", VLLM_REQUESTS)
def test_bad_request_on_vllm_refused_before_any_request(served_llama, call, error, fragments):
    assert_refused_on_vllm(served_llama, call, error, *fragments)


@requires("vllm")
def test_the_longest_prompt_vllm_accepts_is_served(served_llama):
    # vLLM keeps one of max_model_len's positions for the token it predicts: 63 of 64 for a prompt.
    cache = capture(served_llama, [[1] * 63], ["resid_post.2"], progress=False)
    assert cache["resid_post.2"].shape == (1, 63, 128)


@requires("vllm")
@pytest.mark.parametrize("kwargs, error, fragment", [
    ({"foo": 1}, SpecError, "neither a load_model keyword nor a vLLM engine argument"),
    ({"extra_vllm_kwargs": {"enforce_eagre": True}}, SpecError, "did you mean 'enforce_eager'?"),
    ({"extra_vllm_kwargs": {"enforce_eager": False}}, SpecError, "enforce_eager=True"),
    ({"extra_vllm_kwargs": [("enforce_eager", True)]}, InputTypeError, "must be a dict of engine arguments"),
    ({"gpu_memory_utilization": 1.5}, SpecError, "use a number in (0, 1]"),
    ({"max_model_len": 10**6}, SpecError, "use at most 512"),
    ({"quantization": "bnb-8bit"}, BackendError, "use backend=\"eager\""),
    ({"attn_implementation": "eager"}, BackendError, "vLLM picks its own kernels"),
])
def test_bad_vllm_load_refused_before_an_engine_starts(served_llama, tiny_path, kwargs, error, fragment):
    import psutil

    children = len(psutil.Process().children(recursive=True))
    with pytest.raises(error) as info:
        load_model(str(tiny_path("llama")), backend="vllm", **kwargs)
    assert fragment in str(info.value) and "Fix:" in str(info.value), str(info.value)
    assert len(psutil.Process().children(recursive=True)) == children
    assert served_llama.runtime.is_alive()
