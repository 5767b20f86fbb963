"""Nothing survives a call: not a hook after an exception, not another thread's edits."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from interp_engine import capture, steer
from interp_engine import spec as S
from interp_engine.errors import SpecError
from tests.conftest import PROMPTS, assert_pure


def test_exception_inside_a_custom_edit_leaves_nothing_behind(eager):
    model = eager("gpt2")
    before = steer(model, PROMPTS, S.Spec())

    def broken(x):
        raise RuntimeError("user bug")

    # The user's own exception comes out as the library's error naming it, with the original chained as its cause.
    with pytest.raises(SpecError, match="user bug") as caught:
        capture(model, PROMPTS, ["resid_post.1", "q.0"], S.Custom("mlp_act.1", broken))
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert torch.equal(steer(model, PROMPTS, S.Spec()), before)


def test_custom_edit_is_applied(eager):
    model = eager("llama")
    got = capture(model, PROMPTS[0], ["resid_post.0"], S.Custom("resid_post.0", lambda x: x * 0 + 1))
    assert torch.all(got["resid_post.0"] == 1)


def test_threads_with_different_specs_each_get_their_solo_result(eager):
    model = eager("qwen2")
    vectors = [torch.randn(model.d_model, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    specs = [S.Add("resid_post.1", v, scale=float(i)) for i, v in enumerate(vectors)]
    solo = [steer(model, PROMPTS, s) for s in specs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda s: steer(model, PROMPTS, s), specs))
    for a, b in zip(solo, together):
        assert torch.equal(a, b)


def test_a_handle_loaded_in_a_test_is_pure_after_every_function(tiny_path):
    from interp_engine import generate, load_model, logit_lens, run_with_grad

    model = load_model(str(tiny_path("gemma2")), backend="eager", attn_implementation="eager", requires_grad=True)
    model.runtime.load()
    params = [p.detach().clone() for p in model.runtime.model.parameters()]
    ids = torch.tensor([model.tokenize(PROMPTS[0])])
    with torch.inference_mode():
        logits = model.runtime.model(input_ids=ids).logits.clone()
    spec = S.Add("resid_mid.1", torch.ones(model.d_model)) + S.Scale("attn_scores.0", 0.5) + S.Ablate("k.2", how="mean")
    capture(model, PROMPTS, model.points(), spec)
    steer(model, PROMPTS, spec)
    generate(model, PROMPTS, S.Add("resid_mid.1", torch.ones(model.d_model)), max_new_tokens=3, capture=["v.1"])
    logit_lens(model, PROMPTS, spec=spec)
    run_with_grad(model, PROMPTS, spec, loss=lambda lg: lg.sum(), wrt=["resid_post.0", "attn_probs.1"])
    assert_pure(model, params, logits)
