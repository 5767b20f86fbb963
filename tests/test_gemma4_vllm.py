"""Gemma 4 (text) on the vLLM backends against eager (itself checked against HF's own outputs in test_gemma4.py), one
engine per backend for the module: every point at each layer's own widths, plain and under a write at every
writable point; a k write at a layer whose keys the KV-shared layers reuse reaching their patterns and outputs, in
a prefill and through generation. vllm-static's compile (about a minute here) runs with INTERP_ENGINE_SLOW=1."""

import asyncio

import pytest
import torch

from interp_engine import capture, generate, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm.runtime import _LIVE
from interp_engine.errors import InterpEngineError, PointError
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

pytestmark = requires("vllm")
FAMILY = "gemma4_text"
RTOL, ATOL = 1e-4, 1e-4  # fp32; the bound


def _close(a, b, what, model):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)), f"{what}: masked entries differ"
    # Inductor (vllm-static) fuses and reorders reductions: absolute error grows with the magnitude.
    atol = ATOL * max(1.0, b[finite].abs().max().item()) if model.backend == "vllm-static" else ATOL
    err = (a[finite] - b[finite]).abs().max().item()
    assert torch.allclose(a[finite], b[finite], rtol=RTOL, atol=atol), f"{what} on {model.backend}: max abs error {err}"


# Every write the tests make, declared on vllm-static (with every point as a read).
WRITES = ("embed", "resid_pre.1", "q.1", "k.1", "v.0", "z.2", "q.3", "attn_out.1", "resid_mid.2", "mlp_act.3",
          "mlp_out.0", "resid_post.0", "final", "k.0", "resid_mid.3")


@pytest.fixture(scope="module", params=["vllm", pytest.param("vllm-static", marks=requires("slow"))])
def served(request, tiny_path, eager):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    static = dict(static_points=eager(FAMILY).points(), static_writes=WRITES) if request.param == "vllm-static" else {}
    with no_child_survives():
        model = load_model(str(tiny_path(FAMILY)), backend=request.param, **static)
        asyncio.run(model.warmup())
        yield model
        asyncio.run(model.shutdown())


def _writes(d: int) -> S.Spec:
    """A write at every writable point, at the layers that differ: layer 1 is global (heads 64 wide, one KV head)
    and its keys are layer 3's; layer 0's are layer 2's; 2 and 3 are KV-shared with a double-wide MLP."""
    ones, ramp = torch.ones(d), torch.linspace(-1, 1, d)
    return (S.Add("embed", ones, positions=[1, -1]) + S.Add("resid_pre.1", ramp) + S.Scale("q.1", 2.0, heads=[0])
            + S.Scale("k.1", 0.5) + S.Scale("v.0", 0.5, heads=[0]) + S.Ablate("z.2", heads=[1, 2])
            + S.Scale("q.3", 1.5, heads=[3]) + S.Add("attn_out.1", ones) + S.Set("resid_mid.2", ramp, positions="last")
            + S.Ablate("mlp_act.3") + S.Add("mlp_out.0", ramp) + S.Add("resid_post.0", ramp, scale=3.0)
            + S.Scale("final", 1.5, positions=[0]))


def test_every_point_plain_and_under_a_write_at_every_point_equals_eager(served, eager):
    model, reference = served, eager(FAMILY)
    points = model.points()
    assert points == reference.points()
    assert {"q.3", "attn_probs.3", "mlp_act.3"} <= {str(a) for a in points}
    for edits in (S.Spec(), _writes(model.d_model)):
        ours, theirs = capture(model, PROMPTS, points, edits), capture(reference, PROMPTS, points, edits)
        assert ours.lengths == theirs.lengths
        for address in points:
            _close(ours[address], theirs[address], f"{address} {edits!r:.40}", model)
    assert ours["mlp_act.3"].shape[-1] == 2 * ours["mlp_act.1"].shape[-1] and ours["k.1"].shape[2:] == (1, 64)


def test_a_k_write_at_a_source_layer_reaches_the_layers_that_share_its_keys(served, eager):
    """k.1 scaled: layer 3 (attending over layer 1's keys) has other patterns and output, as on eager."""
    model, reference = served, eager(FAMILY)
    read = ["attn_probs.3", "attn_scores.3", "z.3", "logits"]  # not layer 1's patterns: its keys kept for 3's alone
    edit = S.Scale("k.1", 0.25)
    plain, ours, theirs = (capture(model, PROMPTS, read), capture(model, PROMPTS, read, edit),
                           capture(reference, PROMPTS, read, edit))
    for address in read:
        _close(ours[address], theirs[address], f"{address} under {edit!r}", model)
    assert (ours["attn_probs.3"] - plain["attn_probs.3"]).abs().max() > 1e-3


def test_generation_with_a_shared_key_write_equals_eager(served, eager):
    """Every step's sharing layers read the edited keys of layer 0 from vLLM's cache: greedy tokens and the KV-shared
    layer's reads at every generated position equal eager's."""
    model, reference = served, eager(FAMILY)
    spec = S.Scale("k.0", 0.25) + S.Add("resid_mid.3", torch.linspace(-2, 2, model.d_model), positions="last")
    points = ["q.2", "z.2", "resid_post.3"]
    ours = generate(model, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    theirs = generate(reference, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    assert ours.tokens == theirs.tokens
    assert ours.tokens != generate(model, PROMPTS, max_new_tokens=4, stop_at_eos=False).tokens
    for address in points:
        _close(ours.cache[address], theirs.cache[address], f"generated {address}", model)


def test_points_a_layer_lacks_are_refused_on_vllm_before_any_request(served):
    with pytest.raises(InterpEngineError) as err:
        capture(served, PROMPTS, ["k.2", "v.3"], S.Add("k.1", torch.zeros(2, 32)))
    text = str(err.value)
    assert "layer 2 is a KV-shared layer" in text and "k is at layers 0-1" in text and "k holds (1, 64)" in text


def test_a_point_a_layer_lacks_cannot_be_declared_on_vllm_static(tiny_path):
    """Refused at load, before any engine starts, naming the layers that have it."""
    with pytest.raises(PointError, match="(?s)k.3 cannot be declared for .*: layer 3 is a KV-shared layer.*k is at layers 0-1"):
        load_model(str(tiny_path(FAMILY)), backend="vllm-static", static_points=["q.3", "k.3"])
