"""steer() against the baseline, against hand-written HF hooks, and Patch of a run's own cache."""

import pytest
import torch

from interp_engine import capture, steer
from interp_engine import spec as S
from interp_engine.addresses import POINTS
from tests.conftest import PROMPTS


def _hf_logits(model, tokens, module_path, edit, *, pre=False):
    """Logits of the HF model with one hand-written hook applying `edit` at `module_path` (removed after)."""
    hf = model.runtime.model
    module = hf.get_submodule(module_path)
    if pre:
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
    else:
        handle = module.register_forward_hook(
            lambda m, a, out: (edit(out[0]), *out[1:]) if isinstance(out, tuple) else edit(out))
    try:
        with torch.inference_mode():
            return hf(input_ids=tokens).logits
    finally:
        handle.remove()


def _writable(model):
    return [a for a in model.points() if a.point not in ("attn_scores", "attn_probs", "logits") and not a.info.read_only]


def test_zero_vector_equals_baseline_exactly_at_every_point(family, eager):
    model = eager(family)
    tokens = model.to_tokens(PROMPTS[0])
    base = steer(model, tokens, S.Spec())
    cache = capture(model, tokens, _writable(model))
    for address in _writable(model):
        zero = torch.zeros(cache[address].shape[2:])
        assert torch.equal(steer(model, tokens, S.Add(address, zero, scale=3.0)), base), address


def test_patch_of_own_cache_is_identity(family, eager):
    model = eager(family)
    tokens = model.to_tokens(PROMPTS[1])
    base = steer(model, tokens, S.Spec())
    points = model.points()
    cache = capture(model, tokens, points)
    spec = S.Spec(tuple(S.Patch(a, cache) for a in points if a.point != "logits" and not a.info.read_only))
    assert torch.equal(steer(model, tokens, spec), base)


def test_add_at_resid_post_equals_hand_hook(family, eager):
    model = eager(family)
    tokens = model.to_tokens(PROMPTS[2])
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(1))
    layer = 1
    ours = steer(model, tokens, S.Add(f"resid_post.{layer}", vector, scale=2.0))
    theirs = _hf_logits(model, tokens, f"{model.arch.layers}.{layer}", lambda h: h + 2.0 * vector)
    assert (ours - theirs).abs().max() < 1e-5
    assert (ours - steer(model, tokens, S.Spec())).abs().max() > 1e-2, "the edit must change the output"


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma2"])
def test_head_ops_on_z_equal_hand_hooks(family, eager):
    model = eager(family)
    tokens = model.to_tokens(PROMPTS[0])
    o_proj = {"llama": "self_attn.o_proj", "gpt2": "attn.c_proj", "gemma2": "self_attn.o_proj"}[family]
    path = f"{model.arch.layers}.0.{o_proj}"
    d = model.d_head

    def zero_head(h, heads=(1, 3)):
        h = h.clone()
        for i in heads:
            h[..., i * d:(i + 1) * d] = 0
        return h

    def scale_head(h):
        h = h.clone()
        h[..., 2 * d:3 * d] *= 0.5
        return h

    got = steer(model, tokens, S.Ablate("z.0", heads=[1, 3]))
    assert (got - _hf_logits(model, tokens, path, zero_head, pre=True)).abs().max() < 1e-5
    got = steer(model, tokens, S.Scale("z.0", 0.5, heads=[2]))
    assert (got - _hf_logits(model, tokens, path, scale_head, pre=True)).abs().max() < 1e-5


def test_set_mean_ablation_and_positions_equal_hand_hooks(eager):
    model = eager("llama")
    tokens = model.to_tokens(PROMPTS[2])
    n = tokens.shape[1]
    path = f"{model.arch.layers}.1"
    value = torch.randn(model.d_model, generator=torch.Generator().manual_seed(2))

    def set_positions(h, cols):
        h = h.clone()
        h[:, cols] = value
        return h

    for positions, cols in [("last", [n - 1]), ([0, 2], [0, 2]), (-2, [n - 2]), (slice(1, None, 3), list(range(1, n, 3)))]:
        got = steer(model, tokens, S.Set("resid_post.1", value, positions=positions))
        want = _hf_logits(model, tokens, path, lambda h: set_positions(h, cols))
        assert (got - want).abs().max() < 1e-5, positions

    got = steer(model, tokens, S.Ablate("resid_post.1", how="mean"))
    want = _hf_logits(model, tokens, path, lambda h: h.mean(dim=(0, 1), keepdim=True).expand_as(h))
    assert (got - want).abs().max() < 1e-5


def test_edits_at_one_point_apply_in_spec_order(eager):
    model = eager("qwen3")
    tokens = model.to_tokens(PROMPTS[0])
    v = torch.ones(model.d_model)
    a = steer(model, tokens, S.Add("resid_post.0", v) + S.Scale("resid_post.0", 2.0))
    b = steer(model, tokens, S.Scale("resid_post.0", 2.0) + S.Add("resid_post.0", v))
    path = f"{model.arch.layers}.0"
    assert (a - _hf_logits(model, tokens, path, lambda h: (h + v) * 2)).abs().max() < 1e-5
    assert (b - _hf_logits(model, tokens, path, lambda h: h * 2 + v)).abs().max() < 1e-5


def test_capture_reads_after_edits(eager):
    model = eager("llama")
    tokens = model.to_tokens(PROMPTS[0])
    v = torch.randn(model.d_model)
    plain = capture(model, tokens, ["resid_post.0"])["resid_post.0"]
    edited = capture(model, tokens, ["resid_post.0"], S.Add("resid_post.0", v))["resid_post.0"]
    assert torch.allclose(edited, plain + v, atol=1e-6)


def test_attention_pattern_writes(eager):
    model = eager("llama")
    tokens = model.to_tokens(PROMPTS[0])
    cache = capture(model, tokens, ["attn_probs.1", "z.1"])
    # Uniform attention over the causal prefix, written as probs, must give z = running mean of v.
    n = tokens.shape[1]
    uniform = torch.tril(torch.ones(n, n)) / torch.arange(1, n + 1)[:, None]
    pattern = uniform.expand(1, model.n_heads, n, n).clone()
    edited = capture(model, tokens, ["z.1", "v.1"], S.Set("attn_probs.1", pattern))
    v = edited["v.1"].repeat_interleave(model.n_heads // model.n_kv_heads, dim=2)
    want = torch.einsum("qk,bkhd->bqhd", uniform, v)
    assert (edited["z.1"] - want).abs().max() < 1e-5
    assert (edited["z.1"] - cache["z.1"]).abs().max() > 1e-3
    # Zeroing one head's scores makes it uniform over the causal prefix: an edit cannot unmask a future key.
    scored = capture(model, tokens, ["attn_probs.1"], S.Ablate("attn_scores.1", heads=[0]))["attn_probs.1"]
    assert torch.allclose(scored[0, 0], uniform, atol=1e-6)
    assert torch.allclose(scored[0, 1], cache["attn_probs.1"][0, 1])


def test_every_point_is_in_the_table():
    assert set(POINTS) == {"embed", "resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post", "q", "k", "v",
                           "z", "attn_scores", "attn_probs", "mlp_act", "final", "logits", "router_logits",
                           "expert_weights", "expert_out", "attn_result", "mlp_pre", "mlp_pre_linear", "kv_latent",
                           "lin_q", "lin_k", "lin_v", "lin_beta", "lin_g", "lin_z", "lin_out"}


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_zeroed_resid_mid_stays_exactly_zero(family, eager):
    """Bias-free blocks map a zero stream to zero: after zeroing resid_mid at the last layer the MLP reads
    norm(0) = 0 and the logits are exactly 0 (a residue of rounding would be scaled up ~1000x by the norms).
    Setting resid_mid to a vector equals a hand-written hook that sets the MLP norm's input and the block's sum."""
    model = eager(family)
    zeroed = steer(model, PROMPTS, S.Ablate("resid_mid.-1"))
    assert zeroed.shape == (3, max(len(model.tokenize(p)) for p in PROMPTS), model.d_vocab)
    assert torch.equal(zeroed, torch.zeros_like(zeroed))
    last = model.n_layers - 1
    value = torch.linspace(-1, 1, model.d_model)
    tokens = model.to_tokens(PROMPTS[1])
    layer = model.runtime.model.get_submodule(f"{model.arch.layers}.{last}")
    mlp_out = {}
    handles = [layer.get_submodule(model.arch.mid_norm).register_forward_pre_hook(
                   lambda m, args: (value.expand_as(args[0]), *args[1:])),
               layer.get_submodule(model.arch.mlp_out).register_forward_hook(
                   lambda m, a, out: mlp_out.__setitem__("m", out[0] if isinstance(out, tuple) else out)),
               layer.register_forward_hook(
                   lambda m, a, out: (value + mlp_out["m"], *out[1:]) if isinstance(out, tuple) else value + mlp_out["m"])]
    try:
        with torch.inference_mode():
            expected = model.runtime.model(input_ids=tokens).logits
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(steer(model, PROMPTS[1], S.Set("resid_mid.-1", value)), expected)
