"""What the newer families add beyond the family-parametrized tests (tests/test_capture_parity.py and the
others cover their every point against HF): GPT-OSS's attention sinks under a write, its router steered, and its
attention implementation."""

import pytest
import torch

from interp_engine import capture, load_model, steer
from interp_engine import spec as S
from interp_engine.errors import SpecError
from tests.conftest import PROMPTS


def test_gpt_oss_writes_re_softmax_with_the_sink_and_steer_the_router(eager, hf_reference):
    """Setting attn_scores to their own values changes nothing (so the edited scores are softmaxed with the sink
    again: without it every row would sum to 1); negating the router logits chooses what HF chooses with the
    router's weight and bias negated."""
    model, ref = eager("gpt_oss"), hf_reference("gpt_oss")
    tokens = model.to_tokens(PROMPTS[0])
    base = steer(model, tokens, S.Spec())
    scores = capture(model, tokens, ["attn_scores.1"])["attn_scores.1"]
    assert torch.equal(steer(model, tokens, S.Set("attn_scores.1", scores)), base)

    flip = S.Scale("router_logits.0", -1.0)
    plain = capture(model, tokens, ["expert_weights.0"])
    ours = capture(model, tokens, ["expert_weights.0", "logits"], flip)
    assert not torch.equal(plain["expert_weights.0"] > 0, ours["expert_weights.0"] > 0)
    router = ref.model.layers[0].mlp.router
    with torch.inference_mode():
        router.weight.neg_(), router.bias.neg_()
        try:
            theirs = ref(tokens).logits
        finally:
            router.weight.neg_(), router.bias.neg_()
    err = (ours["logits"] - theirs).abs().max().item()
    assert err < 1e-5, err


def test_gpt_oss_attention_defaults_to_eager_and_sdpa_is_refused(tiny_path):
    """HF's GPT-OSS has no SDPA path: the default is eager, and asking for SDPA is refused at load with the fix."""
    path = str(tiny_path("gpt_oss"))
    assert load_model(path, backend="eager", device="cpu").attn_implementation == "eager"
    with pytest.raises(SpecError, match="(?s)no SDPA attention.*Fix"):
        load_model(path, backend="eager", device="cpu", attn_implementation="sdpa")
