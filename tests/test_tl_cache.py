"""The cache helpers under TransformerLens's names, against HF's own forward: decompose_resid sums to the
residual stream; apply_ln_to_stack of the last accumulated residual is HF's final norm output (less its bias);
logit_attrs summed over the components are HF's logit difference (less the constant bias terms TL folds away)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import PROMPTS
from interp_engine import load_model, run_with_cache
from interp_engine.errors import PointError, SpecError
from interp_engine.tiny import build_tiny_model

_CLOSE = dict(rtol=1e-4, atol=1e-4)
_FAMILIES = ("llama", "gpt2", "gemma2", "gpt_neox")


@pytest.fixture(scope="module")
def unit_free(tmp_path_factory):
    """family -> (handle, HF reference) of a tiny model whose norms are not the identity: HF initialises norm
    weights to 1 (Gemma's to 0, i.e. 1 + 0) and biases to 0, which would let a helper ignore them unnoticed."""
    root, out = tmp_path_factory.mktemp("tl_norms"), {}
    generator = torch.Generator().manual_seed(0)
    for family in _FAMILIES:
        folder = build_tiny_model(family, root / family)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or "ln" in name:
                    p.copy_(torch.rand(p.shape, generator=generator) + 0.5)
        model.save_pretrained(str(folder))
        out[family] = (load_model(str(folder), backend="eager", device="cpu", attn_implementation="eager"),
                       AutoModelForCausalLM.from_pretrained(str(folder), attn_implementation="eager",
                                                            dtype=torch.float32).eval())
    return out


def test_helpers_match_hf(unit_free):
    for family in _FAMILIES:
        _check(*unit_free[family], family)


def _check(model, ref, family):
    tokens = model.to_tokens(PROMPTS[1])
    logits, cache = run_with_cache(model, tokens)
    with torch.inference_mode():
        out = ref(tokens, output_hidden_states=True)
    n = model.n_layers
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed"] + [f"{i}_{p}_out" for i in range(n) for p in ("attn", "mlp")]
    torch.testing.assert_close(cache.decompose_resid(layer=2).sum(0), out.hidden_states[2], **_CLOSE)
    torch.testing.assert_close(cache.decompose_resid(layer=1, mlp_input=True).sum(0), cache["resid_mid.1"], **_CLOSE)
    resid, labels = cache.accumulated_resid(return_labels=True, incl_mid=True)
    assert labels[-1] == "final_post" and labels[:3] == ["0_pre", "0_mid", "1_pre"] and len(resid) == 2 * n + 1
    torch.testing.assert_close(resid[2], out.hidden_states[1], **_CLOSE)
    final_norm = model.weights.ln_final
    assert final_norm.b.abs().min() > 0 if family in ("gpt2", "gpt_neox") else not final_norm.b.any()
    normed = cache.apply_ln_to_stack(resid[-1:], model=model)[0]
    torch.testing.assert_close(normed + final_norm.b, out.hidden_states[n], **_CLOSE)
    torch.testing.assert_close(cache.accumulated_resid(apply_ln=True, model=model)[-1], normed, **_CLOSE)
    torch.testing.assert_close(cache.stack_activation("resid_post")[1], out.hidden_states[2], **_CLOSE)
    a, b = model.to_single_token(" capital"), model.to_single_token(" of")
    attrs = cache.logit_attrs(parts, " capital", " of", model=model)
    assert attrs.shape == (2 * n + 1, 1, tokens.shape[1])
    if family != "gemma2":  # its final logit softcap is not linear
        W_U, b_U = ref.get_output_embeddings().weight, ref.get_output_embeddings().bias
        constant = final_norm.b @ (W_U[a] - W_U[b]) + (0 if b_U is None else b_U[a] - b_U[b])
        torch.testing.assert_close(attrs.sum(0), out.logits[..., a] - out.logits[..., b] - constant, **_CLOSE)
    last = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), torch.tensor([a]), model=model, pos_slice=-1)
    torch.testing.assert_close(last, cache.logit_attrs(parts, a, model=model)[..., -1], **_CLOSE)
    if family == "llama":  # inner norms, applied by HF's own modules
        inner = cache.apply_ln_to_stack(cache.accumulated_resid(layer=1)[-1:], 1, model=model)[0]
        with torch.inference_mode():
            torch.testing.assert_close(inner, ref.model.layers[1].input_layernorm(out.hidden_states[1]), **_CLOSE)
            mlp_in = cache.apply_ln_to_stack(cache["resid_mid.1"][None], 1, mlp_input=True, model=model)[0]
            torch.testing.assert_close(mlp_in, ref.model.layers[1].post_attention_layernorm(cache["resid_mid.1"]),
                                       **_CLOSE)


def test_helpers_refuse_with_the_fix(eager):
    model = eager("llama")
    _, cache = run_with_cache(model, PROMPTS[1], ["resid_post.2", "attn_out.0"])
    with pytest.raises(PointError, match=r"lacks embed, mlp_out.0.*\n  Fix: capture them too"):
        cache.decompose_resid()
    with pytest.raises(SpecError, match="pass model=model"):
        cache.apply_ln_to_stack(cache["resid_post.2"][None])
    with pytest.raises(SpecError, match="layer >= 1"):
        cache.stack_activation("resid_post", 0)
    with pytest.raises(PointError, match=r"layer=7.*\n  Fix: pass layer in 0..3"):
        cache.accumulated_resid(7)
    with pytest.raises(SpecError, match="token ids must lie in 0..511"):
        cache.logit_attrs(cache["resid_post.2"][None], 512, model=model)
