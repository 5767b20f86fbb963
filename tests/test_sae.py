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


def _active(point, op, rows):
    """A worker's call with one op at `point`, on `rows` of a one-prompt step of len(rows) positions."""
    from interp_engine.backends.vllm.worker import Active, WorkerCall
    from interp_engine.edits import Step

    n = len(rows)
    step = Step(torch.arange(n)[None], torch.tensor([[n - 1]]), torch.tensor([[n]]), torch.zeros(1, n, dtype=torch.long))
    return Active(WorkerCall({point: (op,)}, frozenset()), torch.tensor(rows), step)


def _dims(d: int):
    """The dims sae_taps checks an SAE against: two layers of a d-wide residual stream."""
    from types import SimpleNamespace

    dims = SimpleNamespace(n_layers=2, d_model=d, layer_sizes=())
    dims.at = lambda layer: dims
    return dims


def test_the_compiled_clamp_tap_equals_the_eager_clamp_and_fails_only_a_call_past_its_slots():
    """static_clamp.ClampTap (the body vllm-static traces) on CPU, against SAE.clamped (eager's, checked against
    HF hooks above): relu with b_dec subtracted, jumprelu and a last-position clamp, three calls in one step;
    then a call whose features find no free slot fails alone."""
    from interp_engine.backends.vllm.static_clamp import ClampTap
    from interp_engine.taps import CLAMP_SLOTS

    d, point = 16, S.Address("resid_post", 1)
    saes = (random_sae(d, 1, 5, apply_b_dec_to_input=True),
            random_sae(d, 1, 6, activation="jumprelu", threshold=torch.full((4 * d,), 0.1)))
    ops = (S.Clamp(saes[0], [3, 7], to=4.0), S.Clamp(saes[1], [7, 9], to=-2.0),
           S.Clamp(saes[0], [7], to=9.0, positions=[-1]))
    x = torch.randn(9, d, generator=torch.Generator().manual_seed(0))

    def active(op, rows):
        return _active(point, op, rows)

    calls = [active(op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4, 5, 6], [7, 8]))]
    tap = ClampTap(16, d, "cpu")
    assert tap.fill(calls, point)
    out = tap(x)
    assert not torch.allclose(out, x, atol=1e-3)
    expected = torch.cat([saes[0].clamped(x[:3], (3, 7), 4.0), saes[1].clamped(x[3:7], (7, 9), -2.0),
                          x[7:8], saes[0].clamped(x[8:], (7,), 9.0)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    tap.reset(16)
    assert torch.equal(tap(x), x), "rows of calls that clamp nothing pass unchanged"
    assert tap.fill(calls, point)  # the next step: the slots already hold these features
    torch.testing.assert_close(tap(x), expected, rtol=1e-5, atol=1e-5)
    tap.reset(16)

    two = [random_sae(d, 1, seed) for seed in (7, 8)]  # 40 features of each: 80 distinct pairs
    many = [active(S.Clamp(sae, list(range(40)), to=1.0), [i]) for i, sae in enumerate(two)]
    assert tap.fill(many, point)
    assert many[0].call.error == "" and f"more than {CLAMP_SLOTS} distinct features" in many[1].call.error
    torch.testing.assert_close(tap(x)[:2], torch.cat([two[0].clamped(x[:1], tuple(range(40)), 1.0), x[1:2]]),
                               rtol=1e-5, atol=1e-5)


def test_the_compiled_splice_tap_equals_the_eager_splice_and_leaves_other_rows_bit_identical():
    """static_splice.SpliceTap (the body vllm-static traces) on CPU, from the SAEs' declarations as the worker gets
    them, against SAE.spliced (eager's, checked against HF hooks above): relu with b_dec subtracted, jumprelu, and
    topk with input normalisation; error=False, error=True and a last-position splice in one step; rows of calls
    that splice nothing are x itself, bit for bit."""
    from interp_engine.backends.vllm.static_splice import SpliceTap
    from interp_engine.sae import KEPT
    from interp_engine.sae_taps import declared_saes

    d, point = 16, S.Address("resid_post", 1)
    saes = (random_sae(d, 1, 5, apply_b_dec_to_input=True),
            random_sae(d, 1, 6, activation="jumprelu", threshold=torch.full((4 * d,), 0.1)),
            random_sae(d, 1, 7, activation="topk", k=5, normalize="constant_norm_rescale"))
    _, _, declared = declared_saes([S.Splice(sae) for sae in saes], _dims(d))
    ops = (S.Splice(saes[0]), S.Splice(saes[1], error=True), S.Splice(saes[2], positions=[-1]),
           S.Splice(saes[2], error=True))
    x = torch.randn(12, d, generator=torch.Generator().manual_seed(0)) * 3

    def active(op, rows):
        return _active(point, op, rows)

    KEPT.update({sae.key: sae for sae in saes})  # as the worker keeps what the driver sent (sae_refs.py)
    try:
        calls = [active(op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4], [5, 6, 7], [8, 9]))]
        tap = SpliceTap(declared, 16, "cpu")
        tap.fill(calls, point)
        out = tap(x)
        expected = torch.cat([saes[0].spliced(x[:3], False), saes[1].spliced(x[3:5], True), x[5:7],
                              saes[2].spliced(x[7:8], False), saes[2].spliced(x[8:10], True), x[10:]])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(out[:3], x[:3], atol=1e-2), "error=False must change the rows"
        assert torch.equal(out[5:7], x[5:7]) and torch.equal(out[10:], x[10:]), "rows not spliced are x"
        tap.reset(16)
        assert torch.equal(tap(x), x), "rows of calls that splice nothing pass unchanged"
        assert all(not c.call.error for c in calls)
    finally:
        for sae in saes:
            KEPT.pop(sae.key, None)


def test_compiled_clamps_of_topk_and_normalised_saes_equal_the_eager_clamp_beside_splices():
    """The splice tap's clamps (SAEs whose features need the whole encode: topk with constant_norm_rescale, relu
    with layer_norm; declared bare, as a user declares clamps), in one step with a splice of the same SAE and a
    plain call, against SAE.clamped (eager's, checked against HF hooks below); a call past one SAE's slots fails
    alone."""
    from interp_engine.backends.vllm.static_splice import SpliceTap
    from interp_engine.sae import KEPT
    from interp_engine.sae_taps import declared_saes
    from interp_engine.taps import CLAMP_SLOTS

    d, point = 32, S.Address("resid_post", 1)  # 128 features: two calls of 40 each find no 64 slots
    saes = (random_sae(d, 1, 7, activation="topk", k=5, normalize="constant_norm_rescale"),
            random_sae(d, 1, 8, normalize="layer_norm", apply_b_dec_to_input=True))
    writes, clamps, declared = declared_saes(["resid_post.1", *saes], _dims(d))
    assert writes == ["resid_post.1"] and clamps == (point, point) and [s.key for s in declared] == [s.key for s in saes]
    ops = (S.Clamp(saes[0], [1, 4], to=6.0), S.Splice(saes[0]), S.Clamp(saes[1], [2], to=-3.0, positions=[-1]),
           S.Clamp(saes[1], [2, 9], to=0.0))
    x = torch.randn(14, d, generator=torch.Generator().manual_seed(0)) * 3
    KEPT.update({sae.key: sae for sae in saes})
    try:
        calls = [_active(point, op, rows) for op, rows in zip(ops, ([0, 1, 2], [3, 4], [5, 6, 7], [8, 9]))]
        tap = SpliceTap(declared, 16, "cpu")
        tap.fill(calls, point)
        out = tap(x)
        expected = torch.cat([saes[0].clamped(x[:3], (1, 4), 6.0), saes[0].spliced(x[3:5], False), x[5:7],
                              saes[1].clamped(x[7:8], (2,), -3.0), saes[1].clamped(x[8:10], (2, 9), 0.0), x[10:]])
        assert not torch.allclose(out[:3], x[:3], atol=1e-2) and not torch.allclose(out[7:10], x[7:10], atol=1e-2)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[5:7], x[5:7]) and torch.equal(out[10:], x[10:]), "rows that edit nothing are x"
        tap.reset(16)
        assert torch.equal(tap(x), x), "rows of calls that clamp nothing pass unchanged"
        tap.fill(calls, point)  # the next step: the slots already hold these features
        torch.testing.assert_close(tap(x), expected, rtol=1e-5, atol=1e-5)
        tap.reset(16)
        assert all(not c.call.error for c in calls)
        many = [_active(point, S.Clamp(saes[0], list(range(i * 40, i * 40 + 40)), to=1.0), [i]) for i in (0, 1)]
        tap.fill(many, point)
        assert many[0].call.error == "" and f"more than {CLAMP_SLOTS} distinct features" in many[1].call.error
        torch.testing.assert_close(tap(x)[:2], torch.cat([saes[0].clamped(x[:1], tuple(range(40)), 1.0), x[1:2]]),
                                   rtol=1e-5, atol=1e-5)
    finally:
        for sae in saes:
            KEPT.pop(sae.key, None)


@pytest.mark.parametrize("raw", ["-1", "0", "abc", "1e9", "4GiB", " 8", "9" * 400 + "x"])
def test_a_hostile_sae_bound_is_refused_with_the_fix(raw, monkeypatch):
    """INTERP_ENGINE_SAE_BYTES, read at each call that uses an SAE: anything but whole positive bytes is refused
    before anything is sent, naming the variable."""
    from interp_engine.backends.vllm import sae_refs
    from interp_engine.errors import SpecError

    monkeypatch.setenv(sae_refs.BOUND_ENV, raw)
    with pytest.raises(SpecError, match="INTERP_ENGINE_SAE_BYTES") as caught:
        sae_refs.bound()
    assert "Fix:" in str(caught.value)
    monkeypatch.setenv(sae_refs.BOUND_ENV, str(3 << 20))
    assert sae_refs.bound() == 3 << 20
