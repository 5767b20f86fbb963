"""attn_result, mlp_pre and mlp_pre_linear (TransformerLens's hook_result, hook_pre and hook_pre_linear) against
hand-written hooks on HF models that interp_engine never touched."""

import pytest
import torch

from interp_engine import capture, load_model, steer
from interp_engine import spec as S
from interp_engine.errors import PointError, SpecError
from tests.conftest import PROMPTS
from tests.skips import requires
from tests.test_capture_parity import O_PROJ, POST_NORMS, _close

# One family per module layout (mistral, qwen3 and gemma3 share llama's and gemma2's).
DENSE = ("llama", "qwen2", "gemma2", "gpt2", "gpt_neox", "phi", "olmo2", "phi3")
# The module whose output is the MLP's pre-activation (the gate's, on a gated MLP), by hand from HF's sources;
# phi3 fuses gate and up into one projection, gate first.
MLP_PRE = {"gpt2": "mlp.c_fc", "gpt_neox": "mlp.dense_h_to_4h", "phi": "mlp.fc1", "phi3": "mlp.gate_up_proj"}
GATED = ("llama", "qwen2", "gemma2", "olmo2", "phi3")


def _head_slices(o_proj: torch.nn.Module, n_heads: int, d_head: int) -> list[torch.Tensor]:
    """Each head's [d_head, d_model] rows of the output projection (GPT-2's Conv1D stores [in, out])."""
    w = o_proj.weight if type(o_proj).__name__ == "Conv1D" else o_proj.weight.T
    return [w[h * d_head:(h + 1) * d_head] for h in range(n_heads)]


def test_attn_result_mlp_pre_and_mlp_pre_linear_match_hand_written_hf_hooks(eager, hf_reference):
    for family in DENSE:
        model, ref = eager(family), hf_reference(family)
        tokens = model.to_tokens(PROMPTS[2])
        i = model.n_layers - 1
        gated = family in GATED
        cache = capture(model, tokens, [f"attn_result.{i}", f"mlp_pre.{i}", f"attn_out.{i}",
                                        *([f"mlp_pre_linear.{i}", f"mlp_act.{i}"] if gated else [])])
        layer, seen = ref.get_submodule(model.arch.layers)[i], {}
        o_proj, pre = layer.get_submodule(O_PROJ[family]), layer.get_submodule(MLP_PRE.get(family, "mlp.gate_proj"))
        hooks = [o_proj.register_forward_hook(lambda m, a, o: seen.update(z=a[0], o=o)),
                 pre.register_forward_hook(lambda m, a, o: seen.update(pre=o))]
        if gated and family != "phi3":
            hooks.append(layer.mlp.up_proj.register_forward_hook(lambda m, a, o: seen.update(up=o)))
        try:
            with torch.inference_mode():
                ref(tokens)
        finally:
            for h in hooks:
                h.remove()
        result, H, dh = cache[f"attn_result.{i}"], model.n_heads, model.d_head
        assert result.shape == (1, tokens.shape[1], H, model.d_model), family
        z = seen["z"].view(*seen["z"].shape[:-1], H, dh)
        with torch.inference_mode():
            for h, w in enumerate(_head_slices(o_proj, H, dh)):
                _close(result[:, :, h], z[:, :, h] @ w)
        bias = o_proj.bias if o_proj.bias is not None else 0
        _close(result.sum(2) + bias, seen["o"])
        if family not in POST_NORMS:  # there attn_out is the post-norm's output, not linear in the heads
            _close(result.sum(2) + bias, cache[f"attn_out.{i}"])
        want = seen["pre"].chunk(2, dim=-1)[0] if family == "phi3" else seen["pre"]
        assert want.shape[-1] == model.d_mlp
        _close(cache[f"mlp_pre.{i}"], want)
        if gated:
            _close(cache[f"mlp_pre_linear.{i}"], seen["pre"].chunk(2, dim=-1)[1] if family == "phi3" else seen["up"])
            act = layer.mlp.activation_fn if family == "phi3" else layer.mlp.act_fn
            with torch.inference_mode():
                _close(act(cache[f"mlp_pre.{i}"]) * cache[f"mlp_pre_linear.{i}"], cache[f"mlp_act.{i}"])


def test_attn_result_and_mlp_pre_in_a_ragged_batch_equal_each_prompt_alone(eager):
    model = eager("phi3")  # the fused gate_up: both halves cut per row
    points = ["attn_result.0", "mlp_pre.1", "mlp_pre_linear.1"]
    both = capture(model, PROMPTS[:2], points)
    for row, prompt in enumerate(PROMPTS[:2]):
        alone = capture(model, prompt, points)
        n = alone["attn_result.0"].shape[1]
        for p in points:
            _close(both[p][row:row + 1, :n], alone[p])
            assert not both[p][row, n:].any(), "padding is zero"


def test_weights_first_read_inside_a_capture_stay_usable_by_autograd(tiny_path):
    """attn_result reads model.weights from inside capture's inference mode; GPT-NeoX's W_Q is a copy cut from
    the fused qkv, which made there would be an inference tensor that autograd refuses."""
    model = load_model(str(tiny_path("gpt_neox")), backend="eager")
    capture(model, PROMPTS[0], ["attn_result.0"])
    x = torch.ones(model.d_model, requires_grad=True)
    (x @ model.weights.layers[0].W_Q[0]).sum().backward()
    assert x.grad is not None and not model.weights.layers[0].W_Q.is_inference()


@pytest.mark.parametrize("family,call,error,fragments", [
    ("llama", lambda m: steer(m, m.to_tokens(PROMPTS[0]), S.Scale("attn_result.0", 2.0)), SpecError,
     ("attn_result.0 is read-only", "write z.0")),
    ("llama", lambda m: steer(m, m.to_tokens(PROMPTS[0]), S.Ablate("mlp_pre.1")), SpecError,
     ("mlp_pre.1 is read-only", "mlp_act.1")),
    ("mixtral", lambda m: capture(m, PROMPTS[0], ["mlp_pre.0", "attn_result.0"]), SpecError,  # both listed
     ("mlp_pre.0 does not exist", "own hidden layer", "attn_result.0 does not exist", "o_proj.weight")),
    ("gpt2", lambda m: capture(m, PROMPTS[0], ["mlp_pre_linear.0"]), PointError,
     ("mlp_pre_linear.0 does not exist", "one input projection", "read mlp_pre")),
])
def test_new_points_refused_with_the_fix(eager, family, call, error, fragments):
    model = eager(family)
    with pytest.raises(error) as info:
        call(model)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@requires("vllm")
def test_new_points_on_vllm_static_are_declared_taps_refused_undeclared_before_the_engine_starts(tiny_path):
    """Both vLLM backends serve them (vllm in its per-request hooks: tests/test_vllm_tl.py; vllm-static from its
    compiled taps: tests/test_vllm_static.py); on vllm-static they are declared like any point, and an undeclared
    one is refused naming static_points. Where the architecture lacks one, declaring it is refused at load."""
    path = str(tiny_path("llama"))
    assert {"attn_result", "mlp_pre", "mlp_pre_linear"} <= {a.point for a in load_model(path, backend="vllm").points()}
    model = load_model(path, backend="vllm-static", static_points=["z.0", "attn_result.1", "mlp_pre_linear.0"])
    assert {"attn_result.1", "mlp_pre_linear.0"} <= {str(a) for a in model.points()}
    with pytest.raises(SpecError) as info:  # both problems at once
        capture(model, PROMPTS[0], ["attn_result.0", "mlp_pre.1"])
    for fragment in ("attn_result.0 is not read by this vllm-static engine", "mlp_pre.1 is not read",
                     "static_points are [z.0, attn_result.1, mlp_pre_linear.0, final, logits]",
                     'static_points=[..., "attn_result.0"]', 'static_points=[..., "mlp_pre.1"]'):
        assert fragment in str(info.value), (fragment, str(info.value))
    assert model.runtime.llm is None, "refused before the engine started"
    with pytest.raises(PointError, match=r"(?s)attn_result.0 cannot be declared for .*mixture-of-experts.*Fix: read z"):
        load_model(str(tiny_path("mixtral")), backend="vllm-static", static_points=["attn_result.0"])
