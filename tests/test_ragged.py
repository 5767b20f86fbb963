"""Ragged batches and chunking: each prompt gets what running it alone gives."""

import pytest
import torch

from interp_engine import capture, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "phi"])
def test_ragged_capture_and_steer_equal_solo_runs(family, eager):
    model = eager(family)
    points = [p for p in model.points() if p.layer in (None, 1)]
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(0))
    spec = S.Add("resid_mid.1", vector, positions="last") + S.Scale("k.1", 1.5, heads=[0])
    batch = capture(model, PROMPTS, points, spec)
    logits = steer(model, PROMPTS, spec)
    lengths = [len(model.tokenize(p)) for p in PROMPTS]
    assert batch.lengths == tuple(lengths) and len(set(lengths)) > 1
    for i, prompt in enumerate(PROMPTS):
        n = lengths[i]
        solo = capture(model, prompt, points, spec)
        for address in points:
            got, want = batch.unpadded(address)[i], solo.unpadded(address)[0]
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(got)), address
            assert torch.allclose(got[finite], want[finite], rtol=1e-4, atol=1e-5), address
        assert (logits[i, :n] - steer(model, prompt, spec)[0]).abs().max() < 1e-5
        assert torch.all(logits[i, n:] == 0), "padding positions are zeros"
        assert torch.all(batch["resid_post.1"][i, n:] == 0)


def test_chunking_gives_the_same_cache(eager):
    model = eager("qwen2")
    prompts = PROMPTS * 3
    spec = S.Add("resid_pre.2", torch.ones(model.d_model), positions=[[1], [2], [3]] * 3)
    whole = capture(model, prompts, ["resid_post.2", "attn_probs.0"], spec, batch_size=64)
    chunked = capture(model, prompts, ["resid_post.2", "attn_probs.0"], spec, batch_size=2)
    for address in whole:
        assert (whole[address] - chunked[address]).abs().max() < 1e-5


def test_per_prompt_positions_edit_only_their_prompt(eager):
    model = eager("llama")
    v = torch.ones(model.d_model)
    spec = S.Set("resid_post.0", v, positions=[[0], "last", slice(1, 3)])
    cache = capture(model, PROMPTS, ["resid_post.0"], spec)["resid_post.0"]
    n = [len(model.tokenize(p)) for p in PROMPTS]
    is_v = (cache == 1).all(-1)
    assert is_v[0].nonzero().flatten().tolist() == [0]
    assert is_v[1].nonzero().flatten().tolist() == [n[1] - 1]
    assert is_v[2].nonzero().flatten().tolist() == [1, 2]


def test_patch_from_another_ragged_run(eager):
    model = eager("mistral")
    source = capture(model, PROMPTS, ["resid_post.1"])
    logits = steer(model, PROMPTS, S.Patch("resid_post.1", source))
    assert (logits - steer(model, PROMPTS, S.Spec())).abs().max() < 1e-6
    # Patching prompt 0's activations into every prompt at position 1 only.
    one = capture(model, PROMPTS[0], ["resid_post.1"])
    cache = capture(model, PROMPTS, ["resid_post.1"], S.Patch("resid_post.1", one, positions=[1]))["resid_post.1"]
    assert torch.equal(cache[2, 1], one["resid_post.1"][0, 1])
    assert torch.equal(cache[2, 2], source["resid_post.1"][2, 2])
