"""capture() against HF's own outputs, and every point against the layer's remaining ops done by hand."""

import torch

from interp_engine import capture
from tests.conftest import PROMPTS

# The output projection of attention per family: z -> (this) -> attention's contribution before extra norms.
O_PROJ = {"llama": "self_attn.o_proj", "mistral": "self_attn.o_proj", "qwen2": "self_attn.o_proj",
          "qwen3": "self_attn.o_proj", "gemma2": "self_attn.o_proj", "gpt2": "attn.c_proj",
          "gpt_neox": "attention.dense", "phi": "self_attn.dense",
          "gemma3_text": "self_attn.o_proj", "olmo2": "self_attn.o_proj", "phi3": "self_attn.o_proj",
          "qwen3_moe": "self_attn.o_proj", "mixtral": "self_attn.o_proj", "gpt_oss": "self_attn.o_proj"}
POST_NORMS = {family: ("post_attention_layernorm", "post_feedforward_layernorm")
              for family in ("gemma2", "gemma3_text", "olmo2")}
ATOL = 1e-5


def _close(a, b, atol=ATOL):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = (a - b).abs().max().item()
    assert err <= atol, f"max abs error {err}"


def test_resid_embed_final_logits_and_probs_match_hf(family, eager, hf_reference):
    model, ref = eager(family), hf_reference(family)
    tokens = model.to_tokens(PROMPTS[2])
    cache = capture(model, tokens, model.points())
    with torch.inference_mode():
        out = ref(tokens, output_hidden_states=True, output_attentions=True)
    n = model.n_layers
    _close(cache["embed"], out.hidden_states[0])
    for layer in range(n - 1):  # HF's last hidden state is after the final norm
        _close(cache[f"resid_post.{layer}"], out.hidden_states[layer + 1])
        _close(cache[f"resid_pre.{layer + 1}"], out.hidden_states[layer + 1])
    _close(cache["final"], out.hidden_states[n])
    _close(cache["logits"], out.logits)
    for layer in range(n):
        _close(cache[f"attn_probs.{layer}"], out.attentions[layer])


def test_every_point_reproduces_the_layer_by_hand(family, eager):
    model = eager(family)
    hf = model.runtime.model
    layers = hf.get_submodule(model.arch.layers)
    cache = capture(model, model.to_tokens(PROMPTS[2]), model.points())
    softcap = getattr(hf.config, "attn_logit_softcapping", None)
    post_attn, post_mlp = POST_NORMS.get(family, (None, None))
    with torch.inference_mode():
        for i in range(model.n_layers):
            layer = layers[i]
            at = lambda p: cache[f"{p}.{i}"]  # noqa: E731
            q, k, v, z = at("q"), at("k"), at("v"), at("z")
            rep = model.n_heads // model.n_kv_heads
            k_rep, v_rep = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k_rep) * layer.get_submodule(
                O_PROJ[family].split(".")[0]).scaling
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            captured = at("attn_scores")
            finite = torch.isfinite(captured)
            future = torch.ones_like(finite[0, 0]).triu(1).bool()
            assert not finite[..., future].any(), "future keys must be -inf"
            _close(captured[finite], scores[finite], 1e-4)
            sinks = getattr(layer.get_submodule(O_PROJ[family].split(".")[0]), "sinks", None)
            if sinks is None:
                _close(torch.softmax(captured, -1), at("attn_probs"))
            else:  # GPT-OSS: each head's sink logit joins the softmax as a column, dropped after it
                sink = sinks.reshape(1, -1, 1, 1).expand(*captured.shape[:-1], 1)
                _close(torch.softmax(torch.cat([captured, sink], -1), -1)[..., :-1], at("attn_probs"))
                assert (at("attn_probs").sum(-1) < 1 - 1e-4).all(), "the sink takes a share of every row"
            _close(torch.einsum("bhqk,bkhd->bqhd", at("attn_probs"), v_rep), z)
            attn = layer.get_submodule(O_PROJ[family])(z.flatten(2))
            if post_attn:
                attn = layer.get_submodule(post_attn)(attn)
            _close(attn, at("attn_out"))
            _close(at("resid_pre") + at("attn_out"), at("resid_mid"))
            if model.arch.moe is not None:
                mlp = _experts_by_hand(layer, at("resid_mid"), at("router_logits"), at("expert_weights"), hf.config)
            else:
                mlp = layer.get_submodule(model.arch.mlp_down)(at("mlp_act"))
            if post_mlp:
                mlp = layer.get_submodule(post_mlp)(mlp)
            _close(mlp, at("mlp_out"))
            _close(at("resid_mid") + at("mlp_out"), at("resid_post"))


def _experts_by_hand(layer, resid_mid, router_logits, expert_weights, config):
    """A sparse MLP redone from its weights: router_logits is the gate's output, expert_weights the renormalised
    softmax of the top k (zero elsewhere; GPT-OSS: the softmax of the top k logits), and the block's output the
    chosen experts' outputs so weighted (GPT-OSS: a clamped SwiGLU with biases, gate and up interleaved)."""
    x = layer.post_attention_layernorm(resid_mid)
    gate = getattr(layer.mlp, "gate", None) or layer.mlp.router
    _close(x @ gate.weight.T + (gate.bias if getattr(gate, "bias", None) is not None else 0), router_logits)
    k = config.num_experts_per_tok
    if config.model_type == "gpt_oss":
        top = router_logits.topk(k, dim=-1)
        weights, chosen = torch.softmax(top.values, -1), top.indices
    else:
        weights, chosen = torch.softmax(router_logits, -1).topk(k, dim=-1)
        if getattr(config, "norm_topk_prob", True):  # Mixtral always renormalises
            weights = weights / weights.sum(-1, keepdim=True)
    dense = torch.zeros_like(router_logits).scatter(-1, chosen, weights)
    _close(dense, expert_weights)
    out = torch.zeros_like(x)
    for e in range(gate.weight.shape[0]):
        out += _expert_by_hand(layer.mlp.experts, x, e, config) * dense[..., e:e + 1]
    return out


def _expert_by_hand(experts, x, e, config):
    """Expert e's output from its weights (GPT-OSS: a clamped SwiGLU with biases, gate and up interleaved)."""
    if config.model_type == "gpt_oss":
        gate_up = x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]
        g, u = gate_up[..., ::2].clamp(max=experts.limit), gate_up[..., 1::2].clamp(-experts.limit, experts.limit)
        return ((u + 1) * g * torch.sigmoid(g * experts.alpha)) @ experts.down_proj[e] + experts.down_proj_bias[e]
    g, u = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ experts.down_proj[e].T


def test_moe_points_match_hf_own_router_and_mlp(eager, hf_reference):
    """router_logits, expert_weights and mlp_out against what HF's own gate and sparse block return (forward hooks
    on a model interp_engine never touched), and router_logits against output_router_logits."""
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        model, ref = eager(family), hf_reference(family)
        tokens = model.to_tokens(PROMPTS[0])
        cache = capture(model, tokens, model.points())
        seen, hooks = {}, []
        for i, layer in enumerate(ref.model.layers):
            hooks.append(layer.get_submodule(model.arch.moe.router).register_forward_hook(
                lambda m, a, out, i=i: seen.__setitem__(("gate", i), out)))
            hooks.append(layer.mlp.register_forward_hook(  # GPT-OSS's block returns (output, router scores)
                lambda m, a, out, i=i: seen.__setitem__(("mlp", i), out[0] if isinstance(out, tuple) else out)))
        try:
            with torch.inference_mode():
                out = ref(tokens, output_router_logits=True)
        finally:
            for h in hooks:
                h.remove()
        shape = (*tokens.shape, model.dims.n_experts)
        for i in range(model.n_layers):
            logits, weights, chosen = seen[("gate", i)]
            _close(cache[f"router_logits.{i}"], logits.view(shape))
            _close(cache[f"router_logits.{i}"], out.router_logits[i].view(shape))
            dense = torch.zeros_like(logits).scatter(-1, chosen, weights.to(logits.dtype))
            _close(cache[f"expert_weights.{i}"], dense.view(shape))
            _close(cache[f"mlp_out.{i}"], seen[("mlp", i)])


def test_expert_out_is_each_chosen_expert_in_the_routers_order(eager, hf_reference):
    """expert_out[..., j, :] is the j-th expert HF's own router chose (hooked on a model interp_engine never
    touched), redone from that expert's weights; weighted by expert_weights and summed it is mlp_out (none of
    these families has shared experts), in a ragged batch too."""
    for family in ("qwen3_moe", "mixtral", "gpt_oss"):
        model, ref = eager(family), hf_reference(family)
        i, k = model.n_layers - 1, ref.config.num_experts_per_tok
        tokens = model.to_tokens(PROMPTS[0])
        cache = capture(model, tokens, [f"expert_out.{i}", f"resid_mid.{i}"])
        layer, seen = ref.get_submodule(model.arch.layers)[i], {}
        hook = layer.get_submodule(model.arch.moe.router).register_forward_hook(
            lambda m, a, o: seen.__setitem__("chosen", o[2]))
        try:
            with torch.inference_mode():
                ref(tokens)
        finally:
            hook.remove()
        out, chosen = cache[f"expert_out.{i}"][0], seen["chosen"]
        assert out.shape == (tokens.shape[1], k, model.d_model)
        with torch.inference_mode():
            x = layer.post_attention_layernorm(cache[f"resid_mid.{i}"][0])
            for j in range(k):
                _close(out[:, j], torch.stack([_expert_by_hand(layer.mlp.experts, x[p], int(chosen[p, j]), ref.config)
                                               for p in range(len(x))]))
        ragged = capture(model, PROMPTS[:2], [f"expert_out.{i}", f"expert_weights.{i}", f"mlp_out.{i}"])
        weights = ragged[f"expert_weights.{i}"].topk(k, dim=-1).values  # sorted: the router's order
        _close((ragged[f"expert_out.{i}"] * weights[..., None]).sum(2), ragged[f"mlp_out.{i}"])
