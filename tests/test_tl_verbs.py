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



def test_logits_at_chosen_positions_are_those_of_the_full_logits(eager, hf_reference):
    """forward/steer(positions=) on ragged prompts: each prompt's own positions, as HF computes them alone."""
    from interp_engine import spec as S

    model, ref = eager("llama"), hf_reference("llama")
    texts = [PROMPTS[0], "Paris", PROMPTS[2]]
    lengths = [len(model.tokenize(t)) for t in texts]
    assert len(set(lengths)) == 3
    with torch.inference_mode():
        alone = [ref(torch.tensor([model.tokenize(t)])).logits[0] for t in texts]
    for positions, picks in [("last", [[n - 1] for n in lengths]), (0, [[0]] * 3),
                             ([-1, 0], [[n - 1, 0] for n in lengths])]:
        expected = torch.stack([alone[b][p] for b, p in enumerate(picks)])
        torch.testing.assert_close(forward(model, texts, positions=positions, batch_size=2, progress=False),
                                   expected, rtol=1e-4, atol=1e-4)
    edit = S.Add("resid_post.0", torch.randn(model.d_model), scale=4.0)
    full = steer(model, texts, edit, progress=False)
    kept = steer(model, texts, edit, positions=[-2, 1], progress=False)
    assert kept.shape == (3, 2, model.d_vocab)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(kept[b], full[b, [n - 2, 1]])
    assert not torch.allclose(kept[:, 0], torch.stack([a[n - 2] for a, n in zip(alone, lengths)]), atol=1e-3)
    with pytest.raises(SpecError, match=rf"positions \[5\] fall outside a prompt of {min(lengths)} tokens"):
        steer(model, texts, edit, positions=5)
    with pytest.raises(SpecError, match="positions='first' is not what forward keeps"):
        forward(model, texts, positions="first")
