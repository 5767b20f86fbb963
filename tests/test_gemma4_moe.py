"""Gemma 4's mixture-of-experts block (26B-A4B) on eager, on a tiny model of its layout (`tiny.py`: gemma4_moe):
every point against HF's own modules on a model interp_engine never touched (router logits against its router's
projection and its router's probabilities, expert_weights against its router's choice, expert_out and mlp_out
against its experts and norms); a router steer against HF whose router projection returns the same edited logits;
the sizer against HF's model on the meta device; vLLM's module tree (INTERP_ENGINE_SLOW=1). The vLLM backends
against eager: test_gemma4_moe_vllm.py."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from interp_engine import capture, steer
from interp_engine import spec as S
from interp_engine.errors import InterpEngineError
from interp_engine.validate import feature_shape
from tests.conftest import PROMPTS
from tests.skips import requires
from tests.vllm_tree import module_tree

FAMILY = "gemma4_moe"


def _close(a, b, atol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs error {err}"


def _seen(ref, tokens, edit=None):
    """HF's forward with its outputs, recording each layer's router projection (logits), router (probabilities,
    top-k weights, top-k ids), experts, dense MLP and norms; `edit(layer, logits)` replaces a projection's output."""
    seen, hooks = {}, []

    def keep(name, i, what="out"):
        def hook(m, args, out):
            seen[(name, i)] = args[0] if what == "in" else out
            if name == "logits" and edit is not None:
                return edit(i, out)
        return hook

    for i, layer in enumerate(ref.model.layers):
        for name, module, what in (("logits", layer.router.proj, "out"), ("router", layer.router, "out"),
                                   ("router_in", layer.router, "in"), ("experts", layer.experts, "out"),
                                   ("experts_in", layer.experts, "in"), ("mid", layer.pre_feedforward_layernorm, "in"),
                                   ("pre", layer.mlp.gate_proj, "out"), ("act", layer.mlp.down_proj, "in"),
                                   ("dense", layer.mlp, "out"), ("mlp", layer.post_feedforward_layernorm, "out")):
            hooks.append(module.register_forward_hook(keep(name, i, what)))
    try:
        with torch.inference_mode():
            out = ref(tokens, output_hidden_states=True, output_router_logits=True)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


@pytest.fixture(scope="module")
def reference(tiny_path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_path(FAMILY)), attn_implementation="eager",
                                                dtype=torch.float32).eval()


def test_every_point_matches_hfs_router_experts_and_norms(eager, reference):
    model, ref = eager(FAMILY), reference
    tokens = model.to_tokens(PROMPTS[2])
    points = model.points()
    assert {p.point for p in points} >= {"router_logits", "expert_weights", "expert_out", "mlp_pre", "mlp_act",
                                        "attn_result"}
    cache = capture(model, tokens, points)
    out, seen = _seen(ref, tokens)
    n, k = model.n_layers, ref.config.top_k_experts
    for i in range(n - 1):
        _close(cache[f"resid_post.{i}"], out.hidden_states[i + 1])
    _close(cache["logits"], out.logits)
    for i, layer in enumerate(ref.model.layers):
        at = lambda p: cache[f"{p}.{i}"].flatten(0, 1)  # noqa: E731 (HF's router sees the rows flat)
        assert torch.equal(seen[("router_in", i)], seen[("mid", i)].flatten(0, 1))  # the router reads resid_mid
        _close(at("router_logits"), seen[("logits", i)])
        _close(at("router_logits").softmax(-1), out.router_logits[i])  # what HF's output_router_logits returns
        _, top_weights, top_ids = seen[("router", i)]
        _close(at("expert_weights"), torch.zeros_like(at("expert_weights")).scatter(-1, top_ids, top_weights))
        scale = layer.router.per_expert_scale.detach()
        assert not torch.allclose(at("expert_weights").sum(-1), torch.ones(())), "per-expert scales left at 1"
        assert torch.equal((at("expert_weights") > 0).sum(-1), torch.full_like(top_ids[:, 0], k))
        # expert_out: each chosen expert's own output (before the weighted sum), highest weight first.
        weights, order = at("expert_weights").topk(k, dim=-1)
        _close((at("expert_out") * weights[..., None]).sum(1), seen[("experts", i)])
        _close(weights / scale[order], torch.gather(out.router_logits[i], 1, order)
               / torch.gather(out.router_logits[i], 1, order).sum(-1, keepdim=True))
        # mlp_out is what the block adds: post_feedforward_layernorm(post_feedforward_layernorm_1(dense MLP) +
        # post_feedforward_layernorm_2(experts)), rebuilt here from our points and HF's norms.
        experts = (at("expert_out") * weights[..., None]).sum(1).view_as(cache[f"mlp_out.{i}"])
        with torch.inference_mode():
            rebuilt = layer.post_feedforward_layernorm(layer.post_feedforward_layernorm_1(seen[("dense", i)])
                                                       + layer.post_feedforward_layernorm_2(experts))
        _close(cache[f"mlp_out.{i}"], rebuilt)
        _close(cache[f"mlp_out.{i}"], seen[("mlp", i)])
        for point, name in (("resid_mid", "mid"), ("mlp_pre", "pre"), ("mlp_act", "act")):
            _close(cache[f"{point}.{i}"], seen[(name, i)])
        _close(cache[f"resid_post.{i}"], (cache[f"resid_mid.{i}"] + cache[f"mlp_out.{i}"]) * layer.layer_scalar)


def test_a_router_steer_chooses_as_hf_does_from_the_same_logits(eager, reference):
    """router_logits.1 + v is HF with its router projection returning logits + v: the same experts, weights and
    logits. Scaling the logits by -1 makes every token take its least likely experts. A zero edit changes
    nothing, bit for bit."""
    model, ref = eager(FAMILY), reference
    tokens = model.to_tokens(PROMPTS[0])
    read = ["expert_weights.1", "expert_out.1", "mlp_out.1", "logits"]
    base = capture(model, tokens, read)
    v = torch.linspace(-3, 3, model.dims.n_experts)
    ours = capture(model, tokens, read, S.Add("router_logits.1", v))
    out, seen = _seen(ref, tokens, edit=lambda i, logits: logits + v if i == 1 else None)
    _, top_weights, top_ids = seen[("router", 1)]
    weights = ours["expert_weights.1"].flatten(0, 1)
    _close(weights, torch.zeros_like(weights).scatter(-1, top_ids, top_weights))
    _close(ours["logits"], out.logits)
    _close(ours["mlp_out.1"], seen[("mlp", 1)])
    moved = ((weights > 0) != (base["expert_weights.1"].flatten(0, 1) > 0)).any(-1)
    assert moved.float().mean() > 0.3, "the steer moved too few tokens to other experts"
    flipped = capture(model, tokens, ["router_logits.0", "expert_weights.0"], S.Scale("router_logits.0", -1.0))
    least = (-capture(model, tokens, ["router_logits.0"])["router_logits.0"]).topk(2, dim=-1).indices
    assert torch.equal((flipped["expert_weights.0"] > 0), torch.zeros_like(flipped["expert_weights.0"], dtype=bool)
                       .scatter(-1, least, True))
    zeros = S.Spec(tuple(S.Add(str(a), torch.zeros(feature_shape(a, model.dims, 1))) for a in model.points()
                         if a.point in ("router_logits", "mlp_act", "mlp_out")))
    assert torch.equal(steer(model, tokens, zeros), steer(model, tokens, S.Spec()))


def test_moe_points_are_refused_before_any_forward_where_wrong(eager):
    model = eager(FAMILY)
    ran = []
    hook = model.runtime.model.register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        with pytest.raises(InterpEngineError) as err:
            steer(model, model.to_tokens(PROMPTS[0]), S.Add("router_logits.0", torch.zeros(4))
                  + S.Add("expert_weights.1", torch.zeros(8)) + S.Add("expert_out.2", torch.zeros(128)))
    finally:
        hook.remove()
    assert not ran
    text = str(err.value)
    assert "router_logits holds (8,)" in text and "router_logits" in text.split("expert_weights", 1)[1], text


@pytest.mark.parametrize("over", [{}, {"enable_moe_block": False}], ids=["26b-a4b-like", "moe-off"])
def test_the_sizer_prices_the_experts_as_hf_builds_them(over):
    """Parameters equal HF's model on the meta device; active parameters count top_k_experts of the experts."""
    from interp_engine.sizing import count_params
    from interp_engine.tiny import _BASE

    config = {**_BASE[FAMILY], "vocab_size": 512, **over}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma4_text", **config))
    counted = count_params({**config, "model_type": "gemma4_text"})
    assert counted.total == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for name, p in hf.named_parameters() if ".experts." in name)
    assert counted.routed == experts
    active = experts * config["top_k_experts"] // config["num_experts"] if config["enable_moe_block"] else 0
    assert counted.active == counted.total - experts + active


@requires("vllm")
@requires("slow")  # a vLLM import and model build in a child: ~45 s on 2 shared cores
def test_the_vllm_table_names_modules_of_vllms_own_gemma4_moe_tree(tiny_path):
    """gemma4.VLLM's router and MLP sites against vLLM 0.32's own module tree for the tiny MoE config: each layer
    has the router (its output the logits), the experts beside the dense MLP and their norms."""
    from interp_engine.arch.gemma4 import VLLM as table

    tree, _ = module_tree(tiny_path(FAMILY), "gemma4", "Gemma4ForCausalLM")
    for i in range(3):
        at = lambda path: f"{table.layers}.{i}.{path}"  # noqa: E731
        assert tree[at(table.router)] == "Gemma4Router"
        assert tree[at(table.router) + ".proj"] == "GateLinear"
        for path in (table.mlp_out, table.mid_norm, table.mlp_down, table.mlp_in, "experts",
                     "post_feedforward_layernorm_1", "post_feedforward_layernorm_2", table.experts_norm):
            assert at(path) in tree, at(path)
