"""SAEs on eager: loading SAELens's and Gemma Scope's files, feature reads against an encode written by hand from
the saved arrays on HF's own hidden states, Clamp/Splice against hand-written HF forward hooks, and refusals
before any forward pass.

sae-lens itself is not the reference: it requires transformer-lens (and datasets, nltk, babe, plotly, ...), which
our pins do not carry, so the reference encode below is written from the files with safetensors and numpy."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from interp_engine import SAE, capture, load_model, load_sae, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError, InterpEngineError, SpecError
from tests.conftest import PROMPTS, random_sae
from tests.skips import requires

LAYER = 1


def _arrays(d_in: int, d_sae: int, seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng(seed)
    return {"W_enc": (g.standard_normal((d_in, d_sae)) / d_in ** 0.5).astype(np.float32),
            "b_enc": (0.1 * g.standard_normal(d_sae)).astype(np.float32),
            "W_dec": (g.standard_normal((d_sae, d_in)) / d_in ** 0.5).astype(np.float32),
            "b_dec": (0.1 * g.standard_normal(d_in)).astype(np.float32),
            "threshold": np.abs(0.2 * g.standard_normal(d_sae)).astype(np.float32)}


def _saelens(folder, arrays, architecture: str, **cfg):
    folder.mkdir(parents=True)
    weights = {k: v for k, v in arrays.items() if k != "threshold" or architecture == "jumprelu"}
    save_file(weights, str(folder / "sae_weights.safetensors"))
    d_in, d_sae = arrays["W_enc"].shape
    (folder / "cfg.json").write_text(json.dumps({
        "architecture": architecture, "d_in": d_in, "d_sae": d_sae, "dtype": "float32", "device": "cpu",
        "normalize_activations": "none", "metadata": {"hook_name": f"blocks.{LAYER}.hook_resid_post"}, **cfg}))
    return folder


def _hand_encode(x: np.ndarray, a: dict, kind: str, k: int = 0, b_dec_in: bool = False) -> np.ndarray:
    pre = (x - a["b_dec"] if b_dec_in else x) @ a["W_enc"] + a["b_enc"]
    if kind == "topk":
        out = np.zeros_like(pre)
        top = np.argsort(-pre, axis=-1)[..., :k]
        np.put_along_axis(out, top, np.maximum(np.take_along_axis(pre, top, -1), 0), -1)
        return out
    relu = np.maximum(pre, 0)
    return relu * (pre > a["threshold"]) if kind == "jumprelu" else relu


@pytest.fixture(scope="module")
def model(eager):
    return eager("llama")


@pytest.fixture(scope="module")
def saes(model, tmp_path_factory):
    """Three SAEs of resid_post.1 as files (SAELens standard with b_dec subtracted, SAELens topk, Gemma Scope
    jumprelu), with the arrays they were written from."""
    root, d = tmp_path_factory.mktemp("saes"), model.d_model
    a = {name: _arrays(d, 4 * d, seed) for seed, name in enumerate(("relu", "topk", "jumprelu"))}
    np.savez(root / "params.npz", **a["jumprelu"])
    return {"relu": (load_sae(_saelens(root / "relu", a["relu"], "standard", apply_b_dec_to_input=True)), a["relu"]),
            "topk": (load_sae(_saelens(root / "topk", a["topk"], "topk", k=8)), a["topk"]),
            "jumprelu": (load_sae(root / "params.npz", reads=f"resid_post.{LAYER}"), a["jumprelu"])}


def _hidden(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[LAYER + 1][0].numpy()


def test_feature_reads_equal_a_hand_written_encode_of_hf_hidden_states(model, saes, hf_reference):
    """Three SAEs read in one capture (one forward pass), each against its own encode of HF's hidden state."""
    reads = {kind: saes[kind][0].features for kind in saes}
    assert [saes[k][0].activation for k in saes] == list(saes)
    assert {r.sae.reads for r in reads.values()} == {S.Address("resid_post", LAYER)}
    cache = capture(model, PROMPTS, list(reads.values()), progress=False)
    assert list(cache) == list(reads.values()), "the point read for the features is not returned unasked"
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenize(prompt)
        hidden = _hidden(hf_reference("llama"), ids)
        for kind, read in reads.items():
            acts = cache[read]
            assert acts.shape == (3, max(len(model.tokenize(p)) for p in PROMPTS), read.sae.d_sae)
            expected = _hand_encode(hidden, saes[kind][1], kind, k=8, b_dec_in=kind == "relu")
            assert np.count_nonzero(expected) > 0, "an SAE that never fires checks nothing"
            np.testing.assert_allclose(acts[i, :len(ids)].numpy(), expected, rtol=1e-4, atol=1e-4, err_msg=kind)
            assert not acts[i, len(ids):].any(), "padding must read as zero features"


def test_top_features_equal_torch_topk_of_a_hand_written_encode(model, saes, hf_reference, monkeypatch):
    """The sparse read against torch.topk of the hand-written dense encode of HF's hidden states, encoded a few
    rows at a time (the chunk shrunk so that a prompt spans several); padding reads as zero values."""
    import interp_engine.sae as sae_module

    sae, a = saes["relu"]
    k, top = 8, sae.top_features(8)
    monkeypatch.setattr(sae_module, "_TOP_CHUNK", 3 * sae.d_sae)
    cache = capture(model, PROMPTS, [top], progress=False)
    values, indices = cache[top]
    width = max(len(model.tokenize(p)) for p in PROMPTS)
    assert values.shape == indices.shape == (3, width, k) and indices.dtype == torch.int64
    for i, prompt in enumerate(PROMPTS):
        ids = model.tokenize(prompt)
        dense = torch.from_numpy(_hand_encode(_hidden(hf_reference("llama"), ids), a, "relu", b_dec_in=True))
        expected = dense.topk(k, dim=-1)
        assert (expected.values > 0).sum() > len(ids), "a read where nothing fires checks no index"
        torch.testing.assert_close(values[i, :len(ids)], expected.values, rtol=1e-4, atol=1e-4)
        fired = expected.values > 0  # a zero's index is torch.topk's pick among the features that did not fire
        assert torch.equal(indices[i, :len(ids)][fired], expected.indices[fired])
        assert not values[i, len(ids):].any(), "padding must read as zero features"
        again = cache.unpadded(top)[i]
        assert torch.equal(again.indices, indices[i, :len(ids)]) and again.shape == (len(ids), k)
    half = cache.to(dtype=torch.float16)[top]
    assert half.values.dtype == torch.float16 and half.indices.dtype == torch.int64


def test_a_spec_with_an_sae_round_trips_through_json_by_content(saes):
    sae = saes["jumprelu"][0]
    spec = S.Clamp(sae, [3, 5], to=4.0) + S.Splice(sae, error=True)
    again = S.Spec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and again.fingerprint() == spec.fingerprint()
    other = S.Clamp(SAE(sae.W_enc.tensor + 1e-3, sae.b_enc, sae.W_dec, sae.b_dec, sae.reads, "jumprelu",
                        sae.threshold), [3, 5], to=4.0)
    assert S.Spec((other,)).fingerprint() != S.Spec((spec.ops[0],)).fingerprint()
    by_reference = spec.to_dict()
    by_reference["ops"][0]["sae"] = {"ref": "0" * 32}  # what a vLLM table holds: only a worker was sent it
    with pytest.raises(SpecError, match="(?s)names SAE '0+\.\.\.0+', which this process was never sent.*Fix"):
        S.Spec.from_dict(by_reference)


def _hooked_logits(hf, ids, edit) -> torch.Tensor:
    """HF's forward with `edit(hidden)` applied to layer LAYER's output by a forward hook: the reference."""
    def hook(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        new = edit(hidden)
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = hf.model.layers[LAYER].register_forward_hook(hook)
    try:
        with torch.no_grad():
            return hf(torch.tensor([ids])).logits[0]
    finally:
        handle.remove()


@pytest.mark.parametrize("kind", ["relu", "topk", "jumprelu"])
def test_clamp_ablate_and_splice_equal_hand_written_hf_hooks(model, saes, hf_reference, kind):
    sae, a = saes[kind]
    t = {k: torch.from_numpy(v) for k, v in a.items()}
    ids = model.tokenize(PROMPTS[2])
    hf = hf_reference("llama")

    def encoded(h):
        return torch.from_numpy(_hand_encode(h.numpy(), a, kind, k=8, b_dec_in=kind == "relu"))

    def clamp(features, to):
        return lambda h: h + (to - encoded(h)[..., features]) @ t["W_dec"][features]

    def splice(h):
        return encoded(h) @ t["W_dec"] + t["b_dec"]

    plain = _hooked_logits(hf, ids, lambda h: h)
    cases = [(S.Clamp(sae, [7], to=25.0), clamp([7], 25.0)),
             (S.Clamp(sae, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], to=0.0), clamp(list(range(1, 11)), 0.0)),
             (S.Splice(sae), splice)]
    for op, edit in cases:
        expected = _hooked_logits(hf, ids, edit)
        assert not torch.allclose(expected, plain, atol=1e-3), f"{op}: the edit must change the logits"
        torch.testing.assert_close(steer(model, [ids], op, progress=False)[0], expected, rtol=1e-4, atol=1e-4)
    same = steer(model, [ids], S.Splice(sae, error=True), progress=False)[0]
    torch.testing.assert_close(same, plain, rtol=1e-4, atol=1e-4)


def test_clamps_of_normalised_saes_and_of_z_and_mlp_act_equal_hand_written_hf_hooks(model, hf_reference):
    """The arithmetic vllm-static now compiles, on eager against HF hooks written from SAELens's formulas: clamps
    of a topk SAE with constant_norm_rescale and of a relu one with layer_norm (x's own scale undone on the
    move), and Clamp and Splice of SAEs of z (o_proj's input) and mlp_act (down_proj's input)."""
    import dataclasses

    dims, hf, ids = model.dims, hf_reference("llama"), model.tokenize(PROMPTS[2])
    z, mlp = dims.n_heads * dims.d_head_v, dims.d_mlp
    at = lambda sae, reads: dataclasses.replace(sae, reads=S.Address.parse(reads))  # noqa: E731
    saes = {"rescaled": random_sae(model.d_model, LAYER, 11, activation="topk", k=8, normalize="constant_norm_rescale"),
            "layer_norm": random_sae(model.d_model, LAYER, 12, normalize="layer_norm"),
            "z": at(random_sae(z, 0, 13, apply_b_dec_to_input=True), f"z.{LAYER}"),
            "mlp": at(random_sae(mlp, 0, 14, activation="topk", k=8), f"mlp_act.{LAYER}")}

    def hand(sae, h, features=None, to=0.0):
        """SAELens's encode of h, then the clamp (error term kept) or, without features, the reconstruction."""
        t = {k: getattr(sae, k).tensor for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
        if sae.normalize == "constant_norm_rescale":
            scale = h.shape[-1] ** 0.5 / h.norm(dim=-1, keepdim=True)
            x, undo = h * scale, lambda y: y / scale
        elif sae.normalize == "layer_norm":
            mu = h.mean(-1, keepdim=True)
            std = (h - mu).std(-1, keepdim=True)
            x, undo = (h - mu) / (std + 1e-5), lambda y: y * std
        else:
            x, undo = h, lambda y: y
        pre = (x - t["b_dec"] if sae.apply_b_dec_to_input else x) @ t["W_enc"] + t["b_enc"]
        if sae.activation == "topk":
            top = pre.topk(sae.k, dim=-1)
            f = torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        else:
            f = pre.relu()
        if features is None:
            y = f @ t["W_dec"] + t["b_dec"]
            return y * std + mu if sae.normalize == "layer_norm" else undo(y)
        return h + undo((to - f[..., features]) @ t["W_dec"][features])

    def hooked(module, edit):
        handle = module.register_forward_pre_hook(lambda m, args: (edit(args[0]), *args[1:]))
        try:
            with torch.no_grad():
                return hf(torch.tensor([ids])).logits[0]
        finally:
            handle.remove()

    layer = hf.model.layers[LAYER]
    plain = _hooked_logits(hf, ids, lambda h: h)
    cases = [(S.Clamp(saes["rescaled"], [2, 6], to=12.0),
              lambda: _hooked_logits(hf, ids, lambda h: hand(saes["rescaled"], h, [2, 6], 12.0))),
             (S.Clamp(saes["layer_norm"], [5], to=9.0),
              lambda: _hooked_logits(hf, ids, lambda h: hand(saes["layer_norm"], h, [5], 9.0))),
             (S.Clamp(saes["z"], [3, 11], to=20.0), lambda: hooked(layer.self_attn.o_proj,
                                                                   lambda h: hand(saes["z"], h, [3, 11], 20.0))),
             (S.Splice(saes["z"]), lambda: hooked(layer.self_attn.o_proj, lambda h: hand(saes["z"], h))),
             (S.Clamp(saes["mlp"], [0, 5], to=15.0), lambda: hooked(layer.mlp.down_proj,
                                                                  lambda h: hand(saes["mlp"], h, [0, 5], 15.0))),
             (S.Splice(saes["mlp"]), lambda: hooked(layer.mlp.down_proj, lambda h: hand(saes["mlp"], h)))]
    for op, reference in cases:
        expected = reference()
        assert not torch.allclose(expected, plain, atol=1e-3), f"{op}: the edit must change the logits"
        torch.testing.assert_close(steer(model, [ids], op, progress=False)[0], expected, rtol=1e-4, atol=1e-4)


def test_gradients_with_respect_to_features_equal_autograd_through_a_hand_written_splice(eager, saes,
                                                                                        hf_reference):
    """Reference: HF's forward with layer LAYER's output replaced by f @ W_dec + b_dec + (h - x_hat) held
    constant, f a leaf; torch.autograd.grad of the same loss with respect to f."""
    sae, a = saes["jumprelu"]
    model, hf = eager("llama", grad=True), hf_reference("llama")
    ids = model.tokenize(PROMPTS[1])
    t = {k: torch.from_numpy(v) for k, v in a.items()}
    leaf = {}

    def hook(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        f = torch.from_numpy(_hand_encode(h.detach().numpy(), a, "jumprelu")).requires_grad_()
        leaf["f"] = f
        x_hat = f @ t["W_dec"] + t["b_dec"]
        new = x_hat + (h - x_hat).detach()
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = hf.model.layers[LAYER].register_forward_hook(hook)
    try:
        value = hf(torch.tensor([ids])).logits[0, -1, 7]
        (expected,) = torch.autograd.grad(value, leaf["f"])
    finally:
        handle.remove()
    out = run_with_grad(model, [ids], loss=lambda logits: logits[0, -1, 7], wrt=[sae.features, "resid_post.0"])
    assert set(out.grads) == {sae.features, S.Address("resid_post", 0)}
    assert expected.abs().max() > 0, "a zero gradient checks nothing"
    torch.testing.assert_close(out.grads[sae.features][0], expected[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.value, value.detach(), rtol=1e-5, atol=1e-5)


def test_steer_feature_adds_the_decoder_row(model, saes):
    sae = saes["relu"][0]
    op = S.steer_feature(sae, 9, scale=3.0)
    assert op == S.Add(f"resid_post.{LAYER}", sae.W_dec.tensor[9], scale=3.0)


def test_bad_saes_and_ops_are_refused_before_any_forward_with_the_fix(model, saes, eager):
    d, sae = model.d_model, saes["jumprelu"][0]
    w = dict(W_enc=torch.randn(d, 16), b_enc=torch.zeros(16), W_dec=torch.randn(16, d), b_dec=torch.zeros(d))
    with pytest.raises(SpecError, match="(?s)swish.*use one of relu, jumprelu, topk"):
        SAE(**w, reads="resid_post.0", activation="swish")
    with pytest.raises(SpecError, match="(?s)jumprelu needs a threshold.*pass threshold="):
        SAE(**w, reads="resid_post.0", activation="jumprelu")
    with pytest.raises(SpecError, match="topk needs k"):
        SAE(**w, reads="resid_post.0", activation="topk")
    for k in (0, 17, 2.5, True, None):
        with pytest.raises(SpecError, match=r"(?s)top_features\(k\) needs k in 1..16.*Fix"):
            SAE(**w, reads="resid_post.0").top_features(k)
    with pytest.raises(SpecError, match=r"features \[16\] do not exist: this SAE has 16 features"):
        S.Clamp(SAE(**w, reads="resid_post.0"), [16], to=1.0)
    transcoder = SAE(torch.randn(model.dims.d_mlp, 16), torch.zeros(16), torch.randn(16, d), torch.zeros(d),
                     reads="mlp_act.0", writes="mlp_out.0")
    with pytest.raises(SpecError, match="(?s)transcoder.*Add/Set at mlp_out.0"):
        S.Clamp(transcoder, [0], to=1.0)

    forwards = []
    hook = model.runtime.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        wide = SAE(torch.randn(d + 1, 16), torch.zeros(16), torch.randn(16, d + 1), torch.zeros(d + 1),
                   reads="resid_post.0")
        with pytest.raises(SpecError, match=f"(?s)reads {d + 1} values per position.*holds {d}"):
            capture(model, PROMPTS, [wide.features], progress=False)
        pattern = SAE(**w, reads="attn_probs.0")
        with pytest.raises(InterpEngineError, match=rf"2 problems(.|\n)*holds {d}(.|\n)*attention pattern"):
            steer(model, PROMPTS, S.Clamp(wide, [0], to=1.0) + S.Splice(pattern), progress=False)
        with pytest.raises(InterpEngineError, match="resid_post.9 does not exist"):
            capture(model, PROMPTS, [SAE(**w, reads="resid_post.9").features], progress=False)
        with pytest.raises(SpecError, match="(?s)a top-k read is a selection.*wrt=\\[sae.features\\]"):
            run_with_grad(eager("llama", grad=True), PROMPTS, loss=lambda logits: logits.sum(),
                          wrt=[sae.top_features(2)])
        with pytest.raises(SpecError, match="leave point= unset"):
            steer(model, PROMPTS, S.Clamp(sae, [0], point="resid_post.0"), progress=False)
    finally:
        hook.remove()
    assert forwards == [], "a refusal must come before any forward pass"


@requires("vllm")
def test_vllm_static_refuses_sae_edits_and_features_of_an_undeclared_point_before_loading(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="vllm-static", static_points=["resid_post.1"],
                       static_writes=["resid_post.1"])
    sae = random_sae(model.d_model, 1, 3)
    with pytest.raises(BackendError, match="(?s)compiled tap.*backend=\"vllm\""):
        steer(model, PROMPTS, S.Clamp(sae, [0], to=1.0), progress=False)
    with pytest.raises(InterpEngineError, match="resid_post.0"):
        capture(model, PROMPTS, [random_sae(model.d_model, 0, 4).features], progress=False)
    assert not model.runtime.is_loaded, "refusals come before the engine loads"


def test_damaged_sae_files_are_refused_with_the_fix(tmp_path):
    """A truncated weights file, a cfg.json nested past any parser's depth or not an object, a truncated npz:
    the library's SpecError with a Fix line, not safetensors', json's or numpy's own exception."""
    arrays = _arrays(8, 16, seed=3)
    cut = _saelens(tmp_path / "cut", arrays, "standard")
    data = (cut / "sae_weights.safetensors").read_bytes()
    (cut / "sae_weights.safetensors").write_bytes(data[: len(data) // 2])
    nested = _saelens(tmp_path / "nested", arrays, "standard")
    (nested / "cfg.json").write_text("[" * 100_000)
    listed = _saelens(tmp_path / "listed", arrays, "standard")
    (listed / "cfg.json").write_text("[1, 2]")
    npz = tmp_path / "params.npz"
    np.savez(npz, **arrays)
    npz.write_bytes(npz.read_bytes()[:200])
    for path, what in ((cut, "could not be read as an SAE file"), (nested, "could not be read as an SAE file"),
                       (listed, "not SAELens's settings object"), (npz, "could not be read as an SAE file")):
        with pytest.raises(SpecError, match=what) as info:
            load_sae(path, reads="resid_post.1")
        assert "Fix:" in str(info.value), path
