"""forward, steer(model, x, None), run_with_cache and capture(dtype=, device=), against HF's own forward."""

import pytest
import torch

from tests.conftest import PROMPTS
from interp_engine import capture, forward, run_with_cache, steer
from interp_engine.errors import SpecError


def test_forward_and_steer_without_a_spec_are_hf_logits(eager, hf_reference):
    model, ref = eager("llama"), hf_reference("llama")
    tokens = model.to_tokens(PROMPTS[2])
    with torch.inference_mode():
        expected = ref(tokens).logits
    torch.testing.assert_close(forward(model, tokens), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(steer(model, tokens, None), expected, rtol=1e-4, atol=1e-4)


def test_run_with_cache_is_logits_and_every_readable_point(eager, hf_reference):
    model, ref = eager("gpt2"), hf_reference("gpt2")
    tokens = model.to_tokens(PROMPTS[1])
    logits, cache = run_with_cache(model, tokens)
    with torch.inference_mode():
        out = ref(tokens, output_hidden_states=True, output_attentions=True)
    torch.testing.assert_close(logits, out.logits, rtol=1e-4, atol=1e-4)
    assert set(cache) == set(model.points())
    torch.testing.assert_close(cache["resid_post.0"], out.hidden_states[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache["attn_probs.1"], out.attentions[1], rtol=1e-4, atol=1e-4)
    only_logits, few = run_with_cache(model, tokens, ["resid_post.0"])
    assert list(few) == [few._key("resid_post.0")] and torch.equal(only_logits, logits)
    with pytest.raises(SpecError, match="run_with_cache\\(\\) got points=\\[\\]"):
        run_with_cache(model, "Hi", [])


def test_capture_converts_dtype_and_device(eager, hf_reference):
    model, ref = eager("llama"), hf_reference("llama")
    tokens = model.to_tokens(PROMPTS[0])
    cache = capture(model, tokens, ["resid_post.1"], dtype=torch.float16, device="cpu")
    with torch.inference_mode():
        expected = ref(tokens, output_hidden_states=True).hidden_states[2]
    assert cache["resid_post.1"].dtype == torch.float16
    torch.testing.assert_close(cache["resid_post.1"], expected.half(), rtol=1e-2, atol=1e-2)
    assert cache.to(dtype=torch.float64)["resid_post.1"].dtype == torch.float64 and \
        cache["resid_post.1"].dtype == torch.float16  # to() returns a new cache

