"""logit_lens against the model's own logits; run_with_grad against torch.autograd.grad by hand."""

import pytest
import torch

from interp_engine import BackendError, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS


def test_logit_lens_last_layer_equals_log_softmax_of_logits(family, eager):
    model = eager(family)
    lens = logit_lens(model, PROMPTS)
    assert lens.shape[:2] == (model.n_layers, len(PROMPTS))
    logits = steer(model, PROMPTS, S.Spec())
    for i, prompt in enumerate(PROMPTS):
        n = len(model.tokenize(prompt))
        want = torch.log_softmax(logits[i, :n], -1)
        assert (lens[-1, i, :n] - want).abs().max() < 1e-4


def test_logit_lens_with_a_spec_and_points(eager):
    model = eager("llama")
    v = torch.randn(model.d_model)
    lens = logit_lens(model, PROMPTS[0], points=["embed", "resid_mid.0"], spec=S.Add("embed", v))
    assert lens.shape[0] == 2
    plain = logit_lens(model, PROMPTS[0], points=["embed"])
    assert (lens[0] - plain[0]).abs().max() > 1e-3


def _hand_grad(model, tokens, layer_path, loss):
    """d loss / d (output of `layer_path`) with a leaf tensor spliced in by a hand-written hook."""
    hf = model.runtime.model
    leaf = {}

    def splice(m, a, out):
        h = out[0] if isinstance(out, tuple) else out
        leaf["x"] = h.detach().requires_grad_(True)
        return (leaf["x"], *out[1:]) if isinstance(out, tuple) else leaf["x"]

    handle = hf.get_submodule(layer_path).register_forward_hook(splice)
    try:
        with torch.enable_grad():
            value = loss(hf(input_ids=tokens).logits)
            (grad,) = torch.autograd.grad(value, leaf["x"])
    finally:
        handle.remove()
    return value.detach(), grad


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2", "phi"])
def test_run_with_grad_equals_autograd_by_hand(family, eager):
    model = eager(family, grad=True)
    tokens = model.to_tokens(PROMPTS[2])
    target = 7

    def loss(logits):
        return torch.log_softmax(logits[:, -1], -1)[:, target].sum()

    # A sparse MLP has no mlp_act: the gradient reaches its router's logits through the routing weights instead.
    mlp, width = ("router_logits.2", model.dims.n_experts) if model.arch.moe else ("mlp_act.2", model.d_mlp)
    got = run_with_grad(model, tokens, loss=loss, wrt=["resid_post.1", "attn_out.0", mlp])
    for address, path in [("resid_post.1", f"{model.arch.layers}.1"),
                          ("attn_out.0", f"{model.arch.layers}.0.{model.arch.attn_out}")]:
        value, grad = _hand_grad(model, tokens, path, loss)
        assert torch.allclose(got.value, value, atol=1e-5)
        assert (got.grads[address] - grad).abs().max() < 1e-5, address
    assert got.grads[mlp].shape == (1, tokens.shape[1], width)
    assert got.grads[mlp].abs().sum() > 0


def test_run_with_grad_through_a_spec_and_on_heads(eager):
    model = eager("llama", grad=True)
    tokens = model.to_tokens(PROMPTS[0])
    v = torch.randn(model.d_model)

    def loss(logits):
        return logits[0, -1].logsumexp(-1)

    got = run_with_grad(model, tokens, S.Add("resid_post.0", v), loss=loss, wrt=["resid_post.1", "q.1"])
    hf = model.runtime.model
    handle = hf.get_submodule(f"{model.arch.layers}.0").register_forward_hook(lambda m, a, out: out + v)
    try:
        value, grad = _hand_grad(model, tokens, f"{model.arch.layers}.1", loss)
    finally:
        handle.remove()
    assert (got.grads["resid_post.1"] - grad).abs().max() < 1e-5
    assert got.grads["q.1"].shape == (1, tokens.shape[1], model.n_heads, model.d_head)
    assert got.grads["q.1"][0, :, :, :].abs().sum() > 0


def test_run_with_grad_needs_requires_grad(eager):
    model = eager("llama")
    with pytest.raises(BackendError, match="requires_grad=True"):
        run_with_grad(model, PROMPTS[0], loss=lambda x: x.sum(), wrt=["resid_post.0"])
