"""logit_lens(positions=, top_k=) returns only what is asked, equal to the same entries of the full lens."""

import pytest
import torch

from tests.conftest import PROMPTS
from interp_engine import LensTop, logit_lens
from interp_engine.errors import SpecError


def test_positions_and_top_k_are_entries_of_the_full_lens_and_bad_ones_are_refused(eager, hf_reference):
    model, ref = eager("llama"), hf_reference("llama")
    prompts = [PROMPTS[0], PROMPTS[1]]  # ragged: "last" and negative indices count in each prompt's own length
    full = logit_lens(model, prompts, points=["resid_post.0", "final"])
    lengths = [len(model.tokenize(p)) for p in prompts]
    last = logit_lens(model, prompts, points=["resid_post.0", "final"], positions="last")
    assert last.shape == (2, 2, 1, model.d_vocab)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(last[:, i, 0], full[:, i, n - 1])
        with torch.inference_mode():  # the final point's lens is the model's own next-token distribution
            hf = ref(torch.tensor([model.tokenize(prompts[i])])).logits[0, -1].log_softmax(-1)
        torch.testing.assert_close(last[1, i, 0], hf, rtol=1e-4, atol=1e-4)
    top = logit_lens(model, prompts, points=["resid_post.0", "final"], positions=[1, -1], top_k=5)
    assert isinstance(top, LensTop) and top.tokens.shape == (2, 2, 2, 5)
    for i, n in enumerate(lengths):
        expected = full[:, i, [1, n - 1]].topk(5, dim=-1)
        torch.testing.assert_close(top.logprobs[:, i], expected.values)
        assert torch.equal(top.tokens[:, i], expected.indices)
    for kwargs, message in [
            (dict(top_k=0), "top_k=0 is outside 1..512"),
            (dict(positions=[40]), r"positions \[40\] fall outside a prompt of 6 tokens.\n  Fix: use indices in -6..5"),
            (dict(positions=[]), "is not what logit_lens keeps")]:
        with pytest.raises(SpecError, match=message):
            logit_lens(model, PROMPTS[1], **kwargs)
