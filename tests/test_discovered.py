"""Architectures without a table, served at the residual stream by structural discovery (arch/discover.py), on
eager and vllm, against HF's own hidden states and logits and against a hand-written HF forward hook.

StableLM's vLLM layer returns (stream, leftover) and takes no residual; Granite's returns the stream alone and
scales embeddings, residual branches and logits by its multipliers. One vLLM engine per architecture."""

import asyncio

import pytest
import torch

from interp_engine import BackendError, LoadError, PointError, capture, load_model, logit_lens, steer
from interp_engine import spec as S
from interp_engine.addresses import Address
from interp_engine.backends.vllm.runtime import _LIVE
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

FAMILIES = ("stablelm", "granite")
RTOL, ATOL = 1e-4, 1e-5  # the validator's fp32 tolerance (validator/comparison/tolerances.py)


def _expected(n_layers: int) -> list[str]:
    return (["embed"] + [f"resid_pre.{i}" for i in range(n_layers)] + [f"resid_post.{i}" for i in range(n_layers)]
            + ["final", "logits"])


def _hf_steered(hf, ids, layer: int, vector: torch.Tensor) -> torch.Tensor:
    """HF's logits with `vector` added to decoder layer `layer`'s output by a hook written here."""
    def add(module, args, out):
        return (out[0] + vector, *out[1:]) if isinstance(out, tuple) else out + vector

    handle = hf.model.layers[layer].register_forward_hook(add)
    try:
        with torch.no_grad():
            return hf(ids).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("family", FAMILIES)
def test_eager_serves_exactly_the_residual_stream_equal_to_hf(family, eager, hf_reference):
    model, hf = eager(family), hf_reference(family)
    assert model.arch.family == f"discovered:{family}"
    assert [str(a) for a in model.points()] == _expected(model.n_layers)
    ids = model.to_tokens(PROMPTS[1])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    ours = capture(model, ids, model.points())
    hidden = out.hidden_states  # embeddings, each layer's output, the last replaced by the final norm's
    for i in range(model.n_layers):
        torch.testing.assert_close(ours[f"resid_pre.{i}"], hidden[i], rtol=0, atol=0)
    for i in range(model.n_layers - 1):
        torch.testing.assert_close(ours[f"resid_post.{i}"], hidden[i + 1], rtol=0, atol=0)
    torch.testing.assert_close(ours["embed"], hidden[0], rtol=0, atol=0)
    torch.testing.assert_close(ours["final"], hidden[-1], rtol=0, atol=0)
    torch.testing.assert_close(ours["logits"], out.logits, rtol=0, atol=0)
    assert (ours[f"resid_post.{model.n_layers - 1}"] - hidden[-1]).abs().max() > 1e-2, "final is after the norm"
    last = f"resid_post.{model.n_layers - 1}"  # the lens through the discovered final norm and unembedding
    lens = logit_lens(model, ids, points=[last])[0]
    torch.testing.assert_close(lens, out.logits.log_softmax(-1), rtol=RTOL, atol=ATOL)
    vector = torch.linspace(-2, 2, model.d_model)
    steered = steer(model, ids, S.Add("resid_post.1", vector))
    torch.testing.assert_close(steered, _hf_steered(hf, ids, 1, vector), rtol=RTOL, atol=ATOL)
    assert (steered - out.logits).abs().max() > 1e-2, "the steer must change the logits"


def test_other_points_are_refused_before_any_forward_naming_the_families_that_have_them(tiny_path):
    model = load_model(str(tiny_path("stablelm")), backend="eager", device="cpu")
    with pytest.raises(PointError) as caught:
        capture(model, PROMPTS[0], ["attn_out.0"])
    message = str(caught.value)
    for part in ("discovered:stablelm", "embed, resid_pre, resid_post, final, logits only", "attn_out",
                 "llama", "gpt2", "gemma2"):
        assert part in message, (part, message)
    with pytest.raises(Exception, match="2 problems") as caught:
        steer(model, PROMPTS[0], S.Scale("q.1", 2.0) + S.Ablate("mlp_out.0"))
    assert "mlp_out needs a table" in str(caught.value) and "q needs a table" in str(caught.value)
    assert not model.is_loaded
    assert not model.capabilities.can_read(Address("z", 0)) and not model.capabilities.can_write(Address("z", 0))


def test_vllm_static_refuses_a_discovered_model_at_load(tiny_path):
    with pytest.raises(BackendError, match="compiles taps only into the families with a table"):
        load_model(str(tiny_path("granite")), backend="vllm-static", static_points=["resid_post.1"])


def test_no_unique_layer_stack_is_refused_saying_what_was_looked_for_and_found(tmp_path):
    from transformers import BartConfig

    # BART's causal LM is its decoder (2 layers) while num_hidden_layers reads its encoder's 3: no stack fits.
    BartConfig(encoder_layers=3, decoder_layers=2, d_model=32, vocab_size=64).save_pretrained(str(tmp_path))
    with pytest.raises(LoadError) as caught:
        load_model(str(tmp_path), backend="eager", device="cpu")
    message = str(caught.value)
    for part in ("'bart' model", "no table", "num_hidden_layers=3", "model.decoder.layers (2)"):
        assert part in message, (part, message)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tiny_path):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path(request.param)), backend="vllm", max_model_len=64)
        asyncio.run(model.warmup())
        yield request.param, model
        asyncio.run(model.shutdown())


@requires("vllm")
def test_vllm_equals_eager_plain_and_under_writes_and_steers_as_hf(served, eager, hf_reference):
    family, model = served
    reference = eager(family)
    assert model.points() == reference.points()
    d = model.d_model
    edits = (S.Add("embed", torch.ones(d), positions=[1, -1]) + S.Add("resid_pre.1", torch.linspace(-1, 1, d))
             + S.Add("resid_post.0", torch.linspace(1, -1, d), scale=3.0) + S.Scale("final", 1.5, positions=[0]))
    for spec in (S.Spec(), edits):
        ours, theirs = capture(model, PROMPTS, model.points(), spec), capture(reference, PROMPTS, model.points(), spec)
        for address in model.points():
            a, b = ours[address], theirs[address]
            err = (a - b).abs().max().item()
            assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), f"{family} {address} {spec!r:.30}: {err}"
    ids = reference.to_tokens(PROMPTS[1])
    vector = torch.linspace(-2, 2, d)
    hooked = _hf_steered(hf_reference(family), ids, 1, vector)
    steered = steer(model, ids, S.Add("resid_post.1", vector))
    torch.testing.assert_close(steered, hooked, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(steered, steer(reference, ids, S.Add("resid_post.1", vector)), rtol=RTOL, atol=ATOL)


class _Layer(torch.nn.Module):
    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


class _HFLayer(torch.nn.Module):
    def forward(self, hidden_states, attention_mask=None):
        return hidden_states


def _tree(layer, norm):
    """A module tree shaped like a vLLM causal LM: model.layers and model.norm."""
    inner = torch.nn.Module()
    inner.layers, inner.norm = torch.nn.ModuleList([layer(), layer()]), norm
    root = torch.nn.Module()
    root.model = inner
    return root


@requires("vllm")
def test_vllm_layouts_that_cannot_be_told_apart_are_refused_not_guessed():
    from types import SimpleNamespace

    from interp_engine.backends.vllm.discover import discover_layout

    config = SimpleNamespace(num_hidden_layers=2)
    # A residual passed between layers, and a final norm that is not vLLM's fused add-norm (Cohere's case).
    with pytest.raises(LoadError, match="is not vLLM's fused add-norm"):
        discover_layout(_tree(_Layer, torch.nn.LayerNorm(4)), config)
    # HF's layers, as vLLM's Transformers fallback runs them.
    with pytest.raises(LoadError, match="not a native vLLM implementation"):
        discover_layout(_tree(_HFLayer, torch.nn.LayerNorm(4)), config)
    with pytest.raises(LoadError, match=r"found model.layers \(2\)"):
        discover_layout(_tree(_Layer, torch.nn.LayerNorm(4)), SimpleNamespace(num_hidden_layers=3))
