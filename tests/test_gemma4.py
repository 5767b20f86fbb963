"""Gemma 4 (text) on eager: per-layer head widths (global layers 64 wide with one KV head whose v is its k, sliding
32 wide with two), per-layer inputs, KV-shared last layers with a double-wide MLP. Every point against HF's own
outputs and its own attention interface on a model interp_engine never touched; writes against HF with its weights
changed or its own modules hooked; what a layer lacks, a vector of another layer's width, and MoE points on this
dense model refused before any forward (the MoE block: test_gemma4_moe.py). Its own module, not in tiny.FAMILIES: the family-parametrized tests assume one head width. The
`vllm` backend against eager: test_gemma4_vllm.py."""


import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.gemma4 import modeling_gemma4

from interp_engine import capture, generate, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.errors import InterpEngineError
from interp_engine.validate import feature_shape
from tests.conftest import PROMPTS
from tests.skips import requires
from tests.vllm_tree import module_tree

FAMILY = "gemma4_text"


def _close(a, b, atol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs error {err}"


@pytest.fixture(scope="module")
def reference(tiny_path):
    """A plain HF model of the tiny Gemma 4 that interp_engine never touched (its own: the attention interface
    is swapped on it to see q, k, v as HF's attention receives them)."""
    return AutoModelForCausalLM.from_pretrained(str(tiny_path(FAMILY)), attn_implementation="eager",
                                                dtype=torch.float32).eval()


def _hooked(ref, tokens):
    """HF's forward twice: with its outputs (hidden states, attention weights), then through an attention
    interface of our own that records what HF's attention receives and returns, with hooks on its modules."""
    with torch.inference_mode():
        out = ref(tokens, output_hidden_states=True, output_attentions=True)
    seen, hooks = {}, []

    def interface(module, query, key, value, mask, **kwargs):
        seen[("q", module.layer_idx)], seen[("k", module.layer_idx)] = query, key
        seen[("v", module.layer_idx)] = value
        return plain(module, query, key, value, mask, **kwargs)

    def keep(name, i, what="out"):
        def hook(m, args, out):
            seen[(name, i)] = args[0] if what == "in" else out
        return hook

    for i, layer in enumerate(ref.model.layers):
        for name, module, what in (("z", layer.self_attn.o_proj, "in"), ("attn_out", layer.post_attention_layernorm,
                                   "out"), ("mid", layer.pre_feedforward_layernorm, "in"),
                                   ("pre", layer.mlp.gate_proj, "out"), ("lin", layer.mlp.up_proj, "out"),
                                   ("act", layer.mlp.down_proj, "in"), ("mlp", layer.post_feedforward_layernorm,
                                                                        "out"),
                                   ("o_proj", layer.post_attention_layernorm, "in")):
            hooks.append(module.register_forward_hook(keep(name, i, what)))
    # HF's eager attention is the module's own function, looked up at each call (a registered name of our own
    # would change the masks HF builds).
    plain = modeling_gemma4.eager_attention_forward
    modeling_gemma4.eager_attention_forward = interface
    try:
        with torch.inference_mode():
            ref(tokens)
    finally:
        modeling_gemma4.eager_attention_forward = plain
        for h in hooks:
            h.remove()
    return out, seen


def test_every_point_matches_hf_at_each_layers_own_width(eager, reference):
    model, ref = eager(FAMILY), reference
    tokens = model.to_tokens(PROMPTS[2])
    cache = capture(model, tokens, model.points())
    out, seen = _hooked(ref, tokens)
    n, cfg = model.n_layers, ref.config
    sliding = cfg.per_layer_config[0]  # the heterogeneous config refuses per-layer keys read globally
    assert (model.d_head, model.n_kv_heads, model.d_mlp) == (sliding.head_dim, sliding.num_key_value_heads,
                                                             cfg.intermediate_size)
    _close(cache["embed"], out.hidden_states[0])
    for i in range(n - 1):
        _close(cache[f"resid_post.{i}"], out.hidden_states[i + 1])
    _close(cache["final"], out.hidden_states[n])
    _close(cache["logits"], out.logits)
    shared = {2: 0, 3: 1}  # the KV-shared layers and the layer whose keys each attends over
    for i in range(n):
        at = lambda p: cache[f"{p}.{i}"]  # noqa: E731
        width, kv_heads = (64, 1) if cfg.layer_types[i] == "full_attention" else (32, 2)
        assert at("q").shape[2:] == (model.n_heads, width) and at("z").shape[2:] == (model.n_heads, width)
        assert at("mlp_act").shape[-1] == cfg.intermediate_size * (2 if i in shared else 1)
        _close(at("q"), seen[("q", i)].transpose(1, 2))
        if i in shared:
            assert f"k.{i}" not in cache and f"v.{i}" not in cache
            _close(seen[("k", i)].transpose(1, 2), cache[f"k.{shared[i]}"])
        else:
            assert at("k").shape[2:] == at("v").shape[2:] == (kv_heads, width)
            _close(at("k"), seen[("k", i)].transpose(1, 2))
            _close(at("v"), seen[("v", i)].transpose(1, 2))
        _close(at("attn_probs"), out.attentions[i])
        _close(at("attn_scores").softmax(-1), at("attn_probs"))
        _close(at("z").flatten(2), seen[("z", i)])
        _close(at("attn_out"), seen[("attn_out", i)])
        _close(at("attn_result").sum(2), seen[("o_proj", i)])  # each head's share of o_proj's output (no bias)
        _close(at("resid_mid"), seen[("mid", i)])
        _close(at("mlp_pre"), seen[("pre", i)])
        _close(at("mlp_pre_linear"), seen[("lin", i)])
        _close(at("mlp_act"), seen[("act", i)])
        _close(at("mlp_out"), seen[("mlp", i)])
    # The per-layer input term is in resid_post only: resid_post != resid_mid + mlp_out where the model adds it.
    assert not torch.allclose(cache["resid_mid.0"] + cache["mlp_out.0"], cache["resid_post.0"], atol=1e-3)


def _theirs(ref, tokens, param, value=0.0):
    with torch.inference_mode():
        saved = param.clone()
        param.fill_(value)
        try:
            return ref(tokens).logits
        finally:
            param.copy_(saved)


def test_writes_equal_hf_with_its_weights_changed_or_its_modules_hooked(eager, reference):
    """k zeroed at layer 1 (a global layer whose keys layer 3 reuses) is HF with layer 1's k_norm weight zeroed:
    the edit reaches the sharing layer. resid_mid.L + v is HF with v added to post_attention_layernorm's output
    (the block's tail, per-layer input and layer scalar, sees it). A zero edit at every writable point changes
    nothing."""
    model, ref = eager(FAMILY), reference
    tokens = model.to_tokens(PROMPTS[0])
    base = steer(model, tokens, S.Spec())
    _close(base, ref(tokens).logits.detach())
    zeros = [S.Add(str(a), torch.zeros(feature_shape(a, model.dims, 1))) for a in model.points()
             if a.point in ("q", "k", "v", "z", "resid_mid", "attn_out", "mlp_act", "mlp_out", "resid_post")]
    assert torch.equal(steer(model, tokens, S.Spec(tuple(zeros))), base)
    _close(steer(model, tokens, S.Scale("k.1", 0.0)), _theirs(ref, tokens, ref.model.layers[1].self_attn.k_norm.weight))
    vector = torch.linspace(-2, 2, model.d_model)
    hook = ref.model.layers[2].post_attention_layernorm.register_forward_hook(lambda m, a, out: out + vector)
    try:
        with torch.inference_mode():
            theirs = ref(tokens).logits
    finally:
        hook.remove()
    _close(steer(model, tokens, S.Add("resid_mid.2", vector)), theirs, 1e-4)
    zeroed = capture(model, tokens, ["resid_mid.1", "mlp_pre.1"], S.Set("resid_mid.1", torch.zeros(model.d_model)))
    assert torch.equal(zeroed["resid_mid.1"], torch.zeros_like(zeroed["resid_mid.1"]))
    assert torch.equal(zeroed["mlp_pre.1"], torch.zeros_like(zeroed["mlp_pre.1"]))


def test_a_k_edit_holds_through_generation(eager):
    """Generation with a KV cache: the shared layers see the edited keys of the layer they reuse at every step
    (greedy tokens equal steer()'s on the whole sequence)."""
    model = eager(FAMILY)
    tokens = model.to_tokens(PROMPTS[1])
    spec = S.Scale("k.0", 0.25)
    out = generate(model, tokens, spec, max_new_tokens=4, stop_at_eos=False)
    forced = steer(model, out.sequences, spec)[0, tokens.shape[1] - 1:-1].argmax(-1)
    assert tuple(forced.tolist()) == out.tokens[0]


def test_what_a_layer_lacks_and_other_widths_are_refused_before_any_forward(eager):
    model = eager(FAMILY)
    ran = []
    hook = model.runtime.model.register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        with pytest.raises(InterpEngineError) as err:
            capture(model, model.to_tokens(PROMPTS[0]), ["k.2", "v.3", "mlp_act.4", "router_logits.1"],
                    S.Spec((S.Add("q.1", torch.zeros(4, 32)), S.Add("k.0", torch.zeros(2, 64)),
                            S.Add("mlp_act.3", torch.zeros(128)), S.Ablate("k.1", heads=(1,)))))
    finally:
        hook.remove()
    assert not ran
    text = str(err.value)
    assert "8 problems" in text, text
    assert "layer 2 is a KV-shared layer" in text and "k is at layers 0-1" in text
    assert "v is at layers 0-1" in text
    assert "q holds (4, 64) per position (layer 1's own widths: n_kv_heads 1, d_head 64)" in text
    assert "k holds (2, 32) per position" in text
    assert "mlp_act holds (256,) per position (layer 3's own widths: n_kv_heads 1, d_head 64, d_mlp 256)" in text
    assert "heads [1] at k.1 do not exist: k has 1 heads" in text
    points = {str(a) for a in model.points()}
    assert {"k.0", "k.1", "q.3", "z.3", "mlp_act.3", "attn_result.3"} <= points and not {"k.2", "v.3"} & points
    with pytest.raises(InterpEngineError, match="differ in head width"):
        model.weights


def test_sdpa_equals_eager(eager):
    model, sdpa = eager(FAMILY), eager(FAMILY, attn="sdpa")
    tokens = model.to_tokens(PROMPTS[1])
    points = ["q.1", "k.1", "v.1", "z.3", "resid_mid.3", "logits"]
    ours, theirs = capture(sdpa, tokens, points), capture(model, tokens, points)
    for p in points:
        _close(ours[p], theirs[p], 1e-4)


@pytest.mark.parametrize("over, kv_floats", [
    ({}, 2 * (2 * 32 + 1 * 64)),  # layer 0 (2 heads x 32) and 1 (1 head x 64) cache k and v; 2 and 3 reuse them
    ({"attention_k_eq_v": False}, 2 * (2 * 32 + 2 * 64)),  # the global layer's own v, with num_key_value_heads
    ({"hidden_size_per_layer_input": 0, "use_double_wide_mlp": False, "num_kv_shared_layers": 0},
     2 * 2 * (2 * 32 + 1 * 64)),
], ids=["e2b-like", "no-k-eq-v", "no-ple-no-sharing"])
def test_the_sizer_prices_gemma4_as_hf_builds_it(over, kv_floats):
    """Parameters equal HF's model built on the meta device (per-layer widths, KV-shared layers without k/v,
    double-wide MLPs, per-layer inputs); KV bytes per token only for the layers that compute their own k and v."""
    from transformers import AutoConfig

    from interp_engine.sizing import count_params, kv_bytes_per_token
    from interp_engine.tiny import _BASE

    config = {**_BASE[FAMILY], "vocab_size": 512, **over}
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(FAMILY, **config))
    assert count_params({**config, "model_type": FAMILY}).total == sum(p.numel() for p in hf.parameters())
    assert kv_bytes_per_token({**config, "model_type": FAMILY}, "auto", dtype="float32") == 4 * kv_floats


@requires("vllm")
@requires("slow")  # a vLLM import and model build in a child: ~45 s on 2 shared cores
def test_the_vllm_table_names_modules_of_vllms_own_gemma4_tree(tiny_path):
    """The vLLM site table (gemma4.VLLM) against vLLM 0.32's own module tree for the tiny config, layer by layer:
    every layer has an Attention module, the KV-shared ones reading layers 0 and 1's caches (as
    `layers.kv_sources` says); the MLP's gate and up projections are merged."""
    from interp_engine.arch import table_for
    from interp_engine.arch.gemma4 import VLLM as table
    from interp_engine.arch.layers import kv_sources

    tree, targets = module_tree(tiny_path(FAMILY), "gemma4", "Gemma4ForCausalLM")
    assert tree[table.layers] == "ModuleList" and table.final_norm in tree
    for i in range(4):
        at = lambda path: f"{table.layers}.{i}.{path}"  # noqa: E731
        for path in (table.o_proj, table.attn_out, table.mlp_out, table.mid_norm, table.mlp_down, table.mlp_in):
            assert at(path) in tree, at(path)
        kind, target = tree[at(table.attention)], targets.get(at(table.attention))
        assert kind == "Attention"
        assert target == ({2: f"{table.layers}.0.{table.attention}", 3: f"{table.layers}.1.{table.attention}"}
                          .get(i)), (i, target)
    config = AutoConfig.from_pretrained(str(tiny_path(FAMILY)))
    assert kv_sources(config, table_for(config)) == {2: 0, 3: 1}


def test_gradients_at_each_layers_width_and_through_the_shared_keys(eager, reference):
    """d loss / d resid_mid.2 equals autograd by hand on HF (at post_attention_layernorm's output, which only
    resid_mid reads); d loss / d k.1 (keys layer 3 reuses) has layer 1's width and agrees with a central difference
    of steered forwards along a direction."""
    model = eager(FAMILY, grad=True)
    tokens = model.to_tokens(PROMPTS[2])

    def loss(logits):
        return torch.log_softmax(logits[:, -1], -1)[:, 7].sum()

    got = run_with_grad(model, tokens, loss=loss, wrt=["resid_mid.2", "k.1", "q.3"])
    leaf = {}

    def splice(m, a, out):
        leaf["x"] = out.detach().requires_grad_(True)
        return leaf["x"]

    handle = reference.model.layers[2].post_attention_layernorm.register_forward_hook(splice)
    try:
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(loss(reference(tokens).logits), leaf["x"])
    finally:
        handle.remove()
    _close(got.grads["resid_mid.2"], grad)
    assert got.grads["k.1"].shape == (1, tokens.shape[1], 1, 64) and got.grads["q.3"].shape[2:] == (4, 64)
    direction, eps = torch.randn(1, 64, generator=torch.Generator().manual_seed(0)), 1e-2
    ahead, back = (loss(steer(model, tokens, S.Add("k.1", direction, scale=s * eps))) for s in (1, -1))
    slope = (ahead - back) / (2 * eps)
    assert torch.allclose(slope, (got.grads["k.1"] * direction).sum(), rtol=1e-2, atol=1e-4)
