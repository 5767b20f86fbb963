"""model.weights in TransformerLens's names and shapes: equal to HF's parameters, and rebuilding what the forward
pass computed from the captured activations (v from ln1(resid_pre), attn_out from z, mlp_out from mlp_act,
logits from final) in every family."""

import pytest
import torch

from tests.conftest import PROMPTS
from interp_engine import load_model, run_with_cache
from interp_engine.errors import BackendError, PointError
from interp_engine.tiny import FAMILIES
from interp_engine.weights import STACKED
from tests.skips import requires

_CLOSE = dict(rtol=1e-4, atol=1e-4)
MOE = ("qwen3_moe", "mixtral", "gpt_oss")  # refused (tested below): TL's per-layer W_in/W_out have no single MoE meaning


def test_weights_rebuild_the_forward_pass(eager):
    for family in FAMILIES:  # one test, not one per family: the purity check after each test costs seconds
        if family not in MOE:
            _check_rebuild(eager, family)


def _check_rebuild(eager, family):
    model = eager(family)
    weights, layer = model.weights, model.weights.layer(1)
    logits, cache = run_with_cache(model, PROMPTS[1], ["resid_pre.1", "v.1", "z.1", "attn_out.1", "mlp_act.1",
                                                       "mlp_out.1", "final"])
    h = layer.ln1(cache["resid_pre.1"]) if layer.ln1 is not None else cache["resid_pre.1"]
    torch.testing.assert_close(torch.einsum("bpd,kdh->bpkh", h, layer.W_V) + layer.b_V, cache["v.1"], **_CLOSE)
    attn = torch.einsum("bphe,hed->bpd", cache["z.1"], layer.W_O) + layer.b_O
    mlp = cache["mlp_act.1"] @ layer.W_out + layer.b_out
    if layer.ln1_post is not None:
        attn, mlp = layer.ln1_post(attn), layer.ln2_post(mlp)
    torch.testing.assert_close(attn, cache["attn_out.1"], **_CLOSE)
    torch.testing.assert_close(mlp, cache["mlp_out.1"], **_CLOSE)
    if family != "gemma2":  # Gemma-2 softcaps the final logits
        torch.testing.assert_close(cache["final"] @ weights.W_U + weights.b_U, logits, **_CLOSE)
    d = model.cfg
    assert model.W_Q.shape == (d.n_layers, d.n_heads, d.d_model, d.d_head)
    assert model.W_K.shape == (d.n_layers, d.n_kv_heads, d.d_model, d.d_head)
    assert model.W_O.shape == (d.n_layers, d.n_heads, d.d_head, d.d_model)
    assert model.W_out.shape == (d.n_layers, d.d_mlp, d.d_model) and model.W_E.shape == (d.d_vocab, d.d_model)


def test_weights_are_hf_parameters(eager, hf_reference):
    model, ref = eager("llama"), hf_reference("llama")
    attn, mlp = ref.model.layers[2].self_attn, ref.model.layers[2].mlp
    d = model.cfg
    torch.testing.assert_close(model.W_Q[2, 3], attn.q_proj.weight[3 * d.d_head:4 * d.d_head].T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_K[2, 1], attn.k_proj.weight[d.d_head:].T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_O[2, 3], attn.o_proj.weight[:, 3 * d.d_head:].T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_gate[2], mlp.gate_proj.weight.T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_in[2], mlp.up_proj.weight.T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_U, ref.lm_head.weight.T, rtol=0, atol=0)
    torch.testing.assert_close(model.W_E, ref.model.embed_tokens.weight, rtol=0, atol=0)
    torch.testing.assert_close(model.weights.ln_final.w, ref.model.norm.weight, rtol=0, atol=0)
    assert not model.b_U.any()
    gpt2, ref2 = eager("gpt2"), hf_reference("gpt2")
    torch.testing.assert_close(gpt2.W_pos, ref2.transformer.wpe.weight, rtol=0, atol=0)
    torch.testing.assert_close(gpt2.weights.layer(0).b_Q.flatten(), ref2.transformer.h[0].attn.c_attn.bias[:128],
                               rtol=0, atol=0)
    gemma, ref3 = eager("gemma2"), hf_reference("gemma2")
    torch.testing.assert_close(gemma.weights.ln_final.w, 1 + ref3.model.norm.weight, rtol=0, atol=0)


@requires("vllm")
def test_bad_requests_are_refused_with_the_fix(eager, tiny_path):
    for index in (3, -4):
        with pytest.raises(PointError, match=r"this model has 3 layers \(0..2\)\.\n  Fix: use a layer in 0..2"):
            eager("llama").weights.layer(index)
    with pytest.raises(PointError, match="no W_gate"):
        eager("gpt2").W_gate
    for family in MOE:
        with pytest.raises(BackendError, match="mixture-of-experts model, whose MLP is per expert"):
            eager(family).weights
    model = load_model(str(tiny_path("qwen3_moe")), backend="vllm", max_model_len=64)
    with pytest.raises(BackendError, match="mixture-of-experts model, whose MLP is per expert"):
        model.weights
    assert not model.is_loaded, "refused before the engine starts"
    plain = load_model(str(tiny_path("llama")), backend="vllm-generate", max_model_len=64)
    with pytest.raises(BackendError, match=r'(?s)plain vLLM engine.*Fix: load with backend="vllm"'):
        plain.weights
    assert not plain.is_loaded


def assert_same_weights(ours, theirs) -> None:
    """Every tensor of two `Weights` bit-equal, with the same shapes, norms and Nones (a vLLM handle's against
    eager's on the same checkpoint: the workers hold the checkpoint's tensors, sharded)."""
    for name in ("W_E", "W_pos", "W_U", "b_U"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    assert len(ours.layers) == len(theirs.layers)
    for i, (a, b) in enumerate(zip(ours.layers, theirs.layers)):
        for name in STACKED:
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), (i, name)
            assert x is None or (x.shape == y.shape and torch.equal(x, y)), (i, name)
    norms = [(n, getattr(a, n), getattr(b, n)) for a, b in zip(ours.layers, theirs.layers)
             for n in ("ln1", "ln2", "ln1_post", "ln2_post")] + [("ln_final", ours.ln_final, theirs.ln_final)]
    for name, x, y in norms:
        assert (x is None) == (y is None), name
        assert x is None or (x.kind == y.kind and x.eps == y.eps and torch.equal(x.w, y.w)
                             and torch.equal(x.b, y.b)), name
