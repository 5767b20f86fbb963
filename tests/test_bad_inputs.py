"""Every bad input gets one clear error naming the fix, raised before any forward pass; the handle still works.

Decisions the cases pin down: NaN and +inf in a vector are refused (-inf only in attn_scores values, a masked key);
conflicting ops at one point are not an error (they apply in spec order, so a later Set wins); a point named twice
in one capture (even as resid_post.0 and resid_post.-3) is read once.
"""

import json

import pytest
import torch

from interp_engine import Address, Spec, capture, generate, load_model, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError, InputTypeError, InterpEngineError, LoadError, PointError, SpecError
from tests.refusals import PROMPT, assert_refused, assert_still_works, forward_calls, tokens_of
from tests.skips import requires


# ------------------------------------------------------------------------------ requests on a loaded handle

def test_the_forward_counter_sees_a_forward_pass(eager):
    model = eager("llama")
    with forward_calls(model) as calls:
        capture(model, tokens_of(model), ["resid_post.0"], progress=False)
    assert calls == [1]


REQUESTS = [
    pytest.param(lambda m: capture(m, tokens_of(m), ["resid_pots.0"]), PointError,
                 ("'resid_pots' is not a point", "did you mean 'resid_post'?"), id="unknown-point"),
    pytest.param(lambda m: capture(m, tokens_of(m), [Address("resid_post", 5)]), PointError,
                 ("resid_post.5 does not exist", "3 layers (0..2)", "Address('resid_post', -1)"),
                 id="layer-out-of-range"),
    pytest.param(lambda m: capture(m, tokens_of(m), ["z.-4"]), PointError,
                 ("z.-4 does not exist", "3 layers (0..2)", "use z.2"), id="negative-layer-out-of-range"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.randn(7))), SpecError,
                 ("vector has shape (7,)", "resid_post holds (128,) per position"), id="vector-shape"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("mlp_act.1", torch.randn(128))), SpecError,
                 ("vector has shape (128,)", "mlp_act holds (256,) per position"), id="vector-shape-d_mlp"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.ones(128, dtype=torch.long))),
                 SpecError, ("dtype torch.int64", "floating-point", "vector.float()"), id="int-vector"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.full((128,), float("nan")))),
                 SpecError, ("NaN", "torch.nan_to_num(vector)"), id="nan-vector"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.randn(128), scale=float("inf"))),
                 SpecError, ("Add.scale is inf", "finite scale"), id="inf-scale"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", [0.0] * 128)), InputTypeError,
                 ("vector must be a torch.Tensor", "torch.tensor(...)"), id="vector-as-list"),
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=lambda logits: logits.sum(), wrt=["resid_post.0"]),
                 BackendError, ("loaded without them", "requires_grad=True"), id="grad-without-requires_grad"),
    pytest.param(lambda m: capture(m, [], ["resid_post.0"]), SpecError,
                 ("prompts is empty", "at least one prompt"), id="empty-prompt-list"),
    pytest.param(lambda m: capture(m, torch.zeros((1, 0), dtype=torch.long), ["resid_post.0"]), SpecError,
                 ("prompt 0 has no tokens",), id="prompt-without-tokens"),
    pytest.param(lambda m: capture(m, torch.tensor([[1, 2, 10**6]]), ["resid_post.0"]), SpecError,
                 ("outside the vocabulary", "[1000000]", "model.to_tokens(text)"), id="token-past-vocab"),
    pytest.param(lambda m: capture(m, [[1, -3, 2]], ["resid_post.0"]), SpecError,
                 ("outside the vocabulary", "[-3]"), id="negative-token-id"),
    pytest.param(lambda m: capture(m, tokens_of(m), ["resid_post.0"], batch_size=0), InputTypeError,
                 ("batch_size=0", "batch_size=16"), id="zero-batch-size"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Scale("q.0", 2.0, heads=[7])), PointError,
                 ("heads [7] at q.0 do not exist", "q has 4 heads", "0..3"), id="heads-out-of-range"),
    # k has n_kv_heads (2), not n_heads (4): a head valid for q is out of range here.
    pytest.param(lambda m: steer(m, tokens_of(m), S.Ablate("k.1", heads=[3])), PointError,
                 ("k has 2 heads", "0..1"), id="kv-heads-out-of-range"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Scale("resid_post.0", 2.0, heads=[0])), SpecError,
                 ("resid_post has no head axis", "drop heads="), id="heads-on-point-without-heads"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.randn(128), positions=[50])),
                 SpecError, ("positions [50]", "past the end of every prompt"), id="positions-past-the-end"),
    pytest.param(lambda m: steer(m, [PROMPT, "Paris is"], S.Add("resid_post.0", torch.randn(128),
                                                               positions=[[0], [1], [0]])),
                 SpecError, ("3 entries for 2 prompts", "one positions entry per prompt"),
                 id="per-prompt-positions-wrong-count"),
    # wrong types reach an InputTypeError naming what the parameter takes (not a type-checker dump)
    pytest.param(lambda m: capture(m, None, ["resid_post.0"]), InputTypeError,
                 ("capture(): tokens=None", "a list of strings, model.to_tokens(text)"), id="tokens-none"),
    pytest.param(lambda m: capture(m, [[1.5, 2.0]], ["resid_post.0"]), InputTypeError,
                 ("tokens=[[1.5, 2.0]]", "a list of token-id lists"), id="tokens-float-lists"),
    pytest.param(lambda m: capture(m, torch.zeros(1, 2, 3, dtype=torch.long), ["resid_post.0"]), SpecError,
                 ("shape (1, 2, 3); expected [batch, pos]",), id="tokens-3d"),
    pytest.param(lambda m: capture(m, [PROMPT, [1, 2]], ["resid_post.0"]), InputTypeError,
                 ("mixes strings and token ids", "all strings or all id lists"), id="tokens-mixed"),
    pytest.param(lambda m: capture(m, [[1] * 600], ["resid_post.0"]), SpecError,
                 ("600 tokens; the model takes at most 512", "truncate it to 512 tokens"), id="prompt-too-long"),
    pytest.param(lambda m: capture(m, tokens_of(m), None), InputTypeError,
                 ("points=None", '["resid_post.3", Address("attn_out", 0)]'), id="points-none"),
    pytest.param(lambda m: capture(m, tokens_of(m), [3]), InputTypeError, ("points=[3]",), id="points-int"),
    pytest.param(lambda m: capture(m, tokens_of(m), []), SpecError,
                 ("points=[]: no point to read", "steer() returns the logits"), id="points-empty"),
    pytest.param(lambda m: capture("llama", PROMPT, ["resid_post.0"]), InputTypeError,
                 ("model='llama'", 'load_model("path/or/repo")'), id="model-not-a-handle"),
    pytest.param(lambda m: steer(m, tokens_of(m), {"op": "Add"}), InputTypeError,
                 ("spec={'op': 'Add'}", "Spec.from_dict(json.load(f))"), id="spec-as-dict"),
    pytest.param(lambda m: steer(m, tokens_of(m), "resid_post.0"), InputTypeError,
                 ("spec='resid_post.0'", 'S.Add("resid_post.3", vector)'), id="spec-as-string"),
    pytest.param(lambda m: capture(m, tokens_of(m), ["resid_post.0"], batch_size=2.0), InputTypeError,
                 ("batch_size=2.0",), id="batch-size-float"),
    # unknown keywords name the nearest one
    pytest.param(lambda m: capture(m, tokens_of(m), ["resid_post.0"], spce=None), InputTypeError,
                 ("capture() has no keyword 'spce'", "did you mean 'spec'?"), id="unknown-keyword-capture"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Spec(), batchsize=4), InputTypeError,
                 ("steer() has no keyword 'batchsize'", "did you mean 'batch_size'?"), id="unknown-keyword-steer"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_token=3), InputTypeError,
                 ("did you mean 'max_new_tokens'?",), id="unknown-keyword-generate"),
    # generate, logit_lens
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=0), SpecError,
                 ("max_new_tokens=0 generates nothing", "max_new_tokens >= 1"), id="generate-zero-tokens"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2.5), InputTypeError,
                 ("max_new_tokens=2.5",), id="generate-float-tokens"),
    pytest.param(lambda m: generate(m, PROMPT, temperature=-1.0), SpecError,
                 ("temperature=-1.0", "temperature >= 0"), id="generate-negative-temperature"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=600), SpecError,
                 ("plus 600 new ones exceeds the model's 512 positions", "lower max_new_tokens"),
                 id="generate-past-max-len"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, capture=["attn_probs.0"]), SpecError,
                 ("cannot be captured while generating", "capture(model, out.sequences"),
                 id="generate-capture-pattern"),
    pytest.param(lambda m: generate(m, PROMPT, S.Scale("attn_scores.0", 0.5), max_new_tokens=2), SpecError,
                 ("cannot be edited while generating", "edit q/k/v instead"), id="generate-edit-pattern"),
    pytest.param(lambda m: logit_lens(m, tokens_of(m), points=["q.0"]), SpecError,
                 ("q.0 is not d_model-shaped", "resid_pre/resid_mid/resid_post"), id="lens-not-residual"),
    pytest.param(lambda m: logit_lens(m, tokens_of(m), points=[]), SpecError,
                 ("points=[]", "leave points unset"), id="lens-empty-points"),
    # values and positions
    pytest.param(lambda m: steer(m, tokens_of(m), S.Set("resid_post.1", torch.full((128,), float("inf")))), SpecError,
                 ("value contains NaN or +inf", "torch.nan_to_num(value)"), id="inf-value"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.full((128,), float("-inf")))),
                 SpecError, ("-inf, which only attn_scores can hold",), id="neg-inf-outside-attn-scores"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.randn(0))), SpecError,
                 ("vector has shape (0,)", "(128,)"), id="empty-vector"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Set("q.0", torch.randn(128))), SpecError,
                 ("value has shape (128,), but q holds (4, 32)", "(one position: n_heads d_head)"),
                 id="set-wrong-feature-shape"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Add("resid_post.0", torch.randn(3, 5, 128))), SpecError,
                 ("vector has shape (3, 5, 128)", "the whole point (1, pos, ...)"), id="whole-point-wrong-batch"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Ablate("z.0", positions=[-50])), SpecError,
                 ("positions [-50]", "indices in -"), id="negative-position-past-the-start"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Ablate("z.0", heads=[-1])), PointError,
                 ("heads [-1] at z.0 do not exist", "0..3"), id="negative-head"),
    # a spec written for a 32-layer model (layer 20) on this 3-layer one
    pytest.param(lambda m: steer(m, tokens_of(m), Spec.from_dict(json.loads(json.dumps(
        Spec((S.Scale("resid_post.20", 2.0),)).to_dict())))), PointError,
                 ("resid_post.20 does not exist", "3 layers"), id="spec-for-a-deeper-model"),
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=None, wrt=["resid_post.0"]), InputTypeError,
                 ("loss=None", "loss=lambda logits"), id="grad-loss-none"),
]


@pytest.mark.parametrize("call, error, fragments", REQUESTS)
def test_bad_request_refused_before_forward(eager, call, error, fragments):
    assert_refused(eager("llama"), call, error, *fragments)


GRAD_REQUESTS = [
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=lambda lg: lg.sum(), wrt=[]), SpecError,
                 ("wrt=[]", 'wrt=["resid_post.0"]'), id="grad-empty-wrt"),
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=lambda lg: lg.sum(), wrt=["resid_post.7"]), PointError,
                 ("resid_post.7 does not exist",), id="grad-wrt-out-of-range"),
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=3, wrt=["resid_post.0"]), InputTypeError,
                 ("loss=3",), id="grad-loss-not-callable"),
    pytest.param(lambda m: run_with_grad(m, tokens_of(m), loss=lambda lg: lg.sum(), wrt=["attn_result.0", "mlp_pre.1"]),
                 SpecError, ("attn_result.0, mlp_pre.1", "would be zeros", "attn_result: z"), id="grad-wrt-read-only"),
]


@pytest.mark.parametrize("call, error, fragments", GRAD_REQUESTS)
def test_bad_gradient_request_refused_before_forward(eager, call, error, fragments):
    assert_refused(eager("llama", grad=True), call, error, *fragments)


def test_a_loss_that_is_not_a_scalar_names_the_reduction(eager):
    model = eager("llama", grad=True)
    with pytest.raises(SpecError, match=r"loss returned \(1, \d+, 512\); gradients need a scalar.*\n  Fix: reduce it"):
        run_with_grad(model, tokens_of(model), loss=lambda logits: logits, wrt=["resid_post.0"])
    assert_still_works(model)


MOE_REQUESTS = [
    pytest.param("llama", lambda m: capture(m, tokens_of(m), ["router_logits.0"]), PointError,
                 ("router_logits.0 does not exist", "dense llama model", "mixtral, qwen3_5_moe, qwen3_moe, qwen3_next"), id="router-on-dense"),
    pytest.param("llama", lambda m: steer(m, tokens_of(m), S.Add("router_logits.1", torch.ones(4))), PointError,
                 ("router_logits.1 does not exist", "mixtral, qwen3_5_moe, qwen3_moe, qwen3_next"), id="router-write-on-dense"),
    pytest.param("mixtral", lambda m: capture(m, tokens_of(m), ["mlp_act.0"]), PointError,
                 ("mlp_act.0 does not exist", "router_logits", "mlp_out"), id="mlp-act-on-moe"),
    pytest.param("qwen3_moe", lambda m: capture(m, tokens_of(m), ["router_logits.3"]), PointError,
                 ("router_logits.3 does not exist", "3 layers"), id="router-layer-out-of-range"),
    pytest.param("mixtral", lambda m: steer(m, tokens_of(m), S.Ablate("expert_weights.0")), SpecError,
                 ("expert_weights.0 is read-only", "write router_logits.0"), id="expert-weights-written"),
    pytest.param("qwen3_moe", lambda m: steer(m, tokens_of(m), S.Add("router_logits.0", torch.ones(4))), SpecError,
                 ("router_logits holds (8,) per position",), id="router-vector-of-the-wrong-width"),
    pytest.param("llama", lambda m: capture(m, tokens_of(m), ["expert_out.0"]), PointError,
                 ("expert_out.0 does not exist", "gpt_oss, mixtral, qwen3_5_moe, qwen3_moe, qwen3_next"), id="expert-out-on-dense"),
    pytest.param("gpt_oss", lambda m: steer(m, tokens_of(m), S.Scale("expert_out.1", 2.0)), SpecError,
                 ("expert_out.1 is read-only", "write router_logits.1", "mlp_out.1"), id="expert-out-written"),
]


@pytest.mark.parametrize("family, call, error, fragments", MOE_REQUESTS)
def test_bad_moe_request_refused_before_forward(eager, family, call, error, fragments):
    assert_refused(eager(family), call, error, *fragments)


@requires("vllm")
def test_expert_out_on_vllm_refusals_come_before_the_engine_starts(tiny_path):
    """expert_out is served on vLLM (recomputed in the worker); a write to it is refused with the fix before any
    engine starts."""
    model = load_model(str(tiny_path("qwen3_moe")), backend="vllm", max_model_len=64)
    assert {"expert_out", "expert_weights"} <= {a.point for a in model.points()}
    with pytest.raises(SpecError, match=r"(?s)expert_out.0 is read-only.*Fix: .*router_logits.0"):
        capture(model, PROMPT, ["mlp_out.0"], S.Scale("expert_out.0", 2.0))
    assert model.runtime.llm is None, "refused before the engine started"
    with pytest.raises(SpecError, match=r"(?s)static_writes=\['expert_out.1'\]: .*only on the eager backend"):
        load_model(str(tiny_path("qwen3_moe")), backend="vllm-static", static_points=["expert_out.1"],
                   static_writes=["expert_out.1"])


def test_a_moe_config_with_dense_layers_is_refused_at_load(tmp_path):
    from interp_engine.tiny import build_tiny_model

    path = build_tiny_model("qwen3_moe", tmp_path / "m", overrides={"mlp_only_layers": [1]})
    with pytest.raises(LoadError, match=r"makes layers \[1\] dense.*\n  Fix: set mlp_only_layers=\[\]"):
        load_model(str(path), backend="eager")


ADDRESSES = [
    pytest.param(lambda: Address(3, 1), ("point must be a string, got int",), id="point-not-a-string"),
    pytest.param(lambda: Address("resid_post", "3"), ("layer of resid_post must be an int, got '3'",), id="layer-str"),
    pytest.param(lambda: Address("resid_post", 1.0), ("must be an int, got 1.0",), id="layer-float"),
    pytest.param(lambda: Address("resid_post", True), ("must be an int, got True",), id="layer-bool"),
    pytest.param(lambda: Address("resid_post"), ("needs a layer", 'Address("resid_post", -1)'), id="missing-layer"),
    pytest.param(lambda: Address("embed", 0), ("takes no layer", 'Address("embed")'), id="layer-on-model-point"),
    pytest.param(lambda: Address.parse(None), ("cannot read an address from NoneType",), id="parse-none"),
    pytest.param(lambda: Address.parse("resid_post.x"), ("cannot read a layer from 'resid_post.x'",), id="parse-layer"),
    pytest.param(lambda: Address.parse(""), ("'' is not a point", "Valid points"), id="parse-empty"),
]


@pytest.mark.parametrize("call, fragments", ADDRESSES)
def test_bad_address_refused(eager, call, fragments):
    with pytest.raises(PointError) as info:
        call()
    assert "Fix:" in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_still_works(eager("llama"))


OPS = [
    pytest.param(lambda: S.Add("resid_post.0", torch.ones(4, dtype=torch.complex64)), SpecError,
                 ("dtype torch.complex64", "vector.float()"), id="complex-vector"),
    pytest.param(lambda: S.Add("resid_post.0", torch.ones(4, dtype=torch.bool)), SpecError,
                 ("dtype torch.bool",), id="bool-vector"),
    pytest.param(lambda: S.Add("resid_post.0", torch.full((4,), float("inf"))), SpecError,
                 ("NaN or +inf",), id="inf-vector"),
    pytest.param(lambda: S.Add("resid_post.0", torch.ones(4), scale="2"), SpecError,
                 ("scale must be a number, got '2'", "scale=2.0"), id="scale-str"),
    pytest.param(lambda: S.Scale("resid_post.0", float("nan")), SpecError, ("factor is nan", "finite factor"),
                 id="factor-nan"),
    pytest.param(lambda: S.Ablate("resid_post.0", how="mean2"), SpecError, ('how="zero" or how="mean"',),
                 id="ablate-how"),
    pytest.param(lambda: S.Ablate("z.0", heads="0"), SpecError, ("heads='0'", "heads=[0, 3]"), id="heads-str"),
    pytest.param(lambda: S.Ablate("z.0", heads=[]), SpecError, ("heads=[]",), id="heads-empty"),
    pytest.param(lambda: S.Ablate("z.0", heads=[True]), SpecError, ("heads=[True]",), id="heads-bool"),
    pytest.param(lambda: S.Ablate("z.0", positions=True), SpecError, ("ambiguous",), id="positions-bool"),
    pytest.param(lambda: S.Ablate("z.0", positions=1.5), SpecError, ("cannot read positions from 1.5",),
                 id="positions-float"),
    pytest.param(lambda: S.Ablate("z.0", positions=[]), SpecError, ("selects nothing",), id="positions-empty"),
    pytest.param(lambda: S.Ablate("z.0", positions="first"), SpecError, ('"all", "last"',), id="positions-word"),
    pytest.param(lambda: S.Ablate("z.0", positions=slice(0, 3, 0)), SpecError, ("step must be positive",),
                 id="positions-slice-step-0"),
    pytest.param(lambda: S.Ablate("z.0", positions=[[[1]]]), SpecError, ("nest one list per prompt",),
                 id="positions-nested-per-prompt"),
    pytest.param(lambda: S.Custom("resid_post.0", 3), InputTypeError, ("Custom.fn must be callable",),
                 id="custom-not-callable"),
    pytest.param(lambda: Spec(("resid_post.0",)), InputTypeError, ("Spec holds ops",), id="spec-of-strings"),
    pytest.param(lambda: S.Ablate("z.0") + 3, InputTypeError, ("got int",), id="op-plus-int"),
    pytest.param(lambda: Spec((S.Custom("resid_post.0", lambda x: x),)).to_dict(), SpecError,
                 ("cannot be serialised",), id="custom-to-dict"),
]


@pytest.mark.parametrize("call, error, fragments", OPS)
def test_bad_op_refused_when_built(eager, call, error, fragments):
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, InterpEngineError) and "Fix:" in str(info.value), str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert_still_works(eager("llama"))


def test_a_custom_edit_of_the_wrong_shape_is_refused_and_leaves_no_hook(eager):
    # Raised from inside the forward (a Custom fn's output is only known there); the hooks still go.
    model = eager("llama")
    with pytest.raises(SpecError, match=r"returned \(\d+, 128\); expected shape \(1, \d+, 128\)"):
        steer(model, tokens_of(model), S.Custom("resid_post.0", lambda x: x[0]))
    assert_still_works(model)


# ------------------------------------------------------------------------- accepted on purpose (documented)

def test_conflicting_ops_at_one_point_apply_in_spec_order(eager):
    model = eager("llama")
    a, b = torch.zeros(128), torch.ones(128)
    both = capture(model, tokens_of(model), ["resid_post.1"], S.Set("resid_post.1", a) + S.Set("resid_post.1", b))
    assert torch.equal(both["resid_post.1"], torch.ones_like(both["resid_post.1"]))
    scaled = capture(model, tokens_of(model), ["resid_post.1"], S.Set("resid_post.1", b) + S.Scale("resid_post.1", 3.0))
    assert torch.equal(scaled["resid_post.1"], torch.full_like(scaled["resid_post.1"], 3.0))


def test_duplicate_addresses_are_read_once(eager):
    model = eager("llama")
    cache = capture(model, tokens_of(model),
                    ["resid_post.0", "resid_post.0", "resid_post.-3", Address("resid_post", 0)])
    assert list(cache) == [Address("resid_post", 0)]
    assert torch.equal(cache["resid_post.-3"], cache["resid_post.0"])


def test_neg_inf_is_accepted_in_attention_scores_as_a_masked_key(eager):
    model = eager("llama")
    n = tokens_of(model).shape[1]
    scores = torch.zeros(1, model.n_heads, n, n)
    scores[..., 0] = float("-inf")  # the last query row no longer sees key 0
    probs = capture(model, tokens_of(model), ["attn_probs.0"], S.Set("attn_scores.0", scores, positions=[-1]))
    assert float(probs["attn_probs.0"][0, :, -1, 0].abs().max()) == 0.0
    assert torch.allclose(probs["attn_probs.0"][0, :, -1, 1:], torch.full((model.n_heads, n - 1), 1 / (n - 1)))


def test_an_attention_pattern_value_needs_the_whole_point(eager):
    assert_refused(eager("llama"), lambda m: steer(m, tokens_of(m), S.Set("attn_scores.0", torch.zeros(5))),
                   SpecError, "value has shape (5,)", "pass the whole point (1, 4, q_pos, k_pos)")


def test_float64_vectors_are_cast_to_the_model_dtype(eager):
    model = eager("llama")
    v = torch.randn(128, dtype=torch.float64)
    assert torch.equal(steer(model, tokens_of(model), S.Add("resid_post.0", v)),
                       steer(model, tokens_of(model), S.Add("resid_post.0", v.float())))


def test_errors_are_also_builtin_exceptions(eager):
    model = eager("llama")
    with pytest.raises(LookupError):
        capture(model, tokens_of(model), ["resid_pots.0"])
    with pytest.raises(ValueError):
        steer(model, tokens_of(model), S.Add("resid_post.0", torch.randn(7)))
    with pytest.raises(NotImplementedError):
        run_with_grad(model, tokens_of(model), loss=lambda logits: logits.sum(), wrt=["resid_post.0"])


def test_wrong_argument_types_stop_at_the_type_checker(eager):
    model = eager("llama")
    with forward_calls(model) as calls, pytest.raises(TypeError):
        capture(model, torch.ones(1, 4), ["resid_post.0"])  # float token ids
    assert not calls
    assert_still_works(model)


def test_spec_built_for_a_bigger_model_names_both_shapes(eager):
    # What another model's Spec.to_dict() wrote: a steering vector for d_model 256, read back from JSON.
    foreign = json.loads(json.dumps(Spec((S.Add("resid_post.1", torch.randn(256), scale=4.0),)).to_dict()))
    spec = Spec.from_dict(foreign)
    model = eager("llama")
    assert_refused(model, lambda m: steer(m, tokens_of(m), spec), SpecError, "(256,)", "(128,)", "resid_post.1")


def test_several_problems_are_listed_at_once_and_numbered(eager):
    spec = (S.Add("resid_post.0", torch.randn(7)) + S.Scale("q.9", 2.0) + S.Ablate("z.0", heads=[11]))
    message = assert_refused(eager("llama"), lambda m: steer(m, tokens_of(m), spec), SpecError,
                             "3 problems with this request (nothing was run)")
    lines = message.splitlines()
    numbered = [line for line in lines if line[:3] in ("1. ", "2. ", "3. ")]
    assert [line[:3] for line in numbered] == ["1. ", "2. ", "3. "], message
    assert "(7,)" in numbered[0] and "q.9" in numbered[1] and "heads [11]" in numbered[2]
    assert message.count("Fix:") == 3


@pytest.mark.parametrize("call", [
    pytest.param(lambda m: capture(m, tokens_of(m), ["attn_probs.0"]), id="capture-attn_probs"),
    pytest.param(lambda m: capture(m, tokens_of(m), ["attn_scores.2"]), id="capture-attn_scores"),
    pytest.param(lambda m: steer(m, tokens_of(m), S.Ablate("attn_probs.1", heads=[0])), id="edit-attn_probs"),
])
def test_attention_patterns_need_eager_attention(eager, call):
    assert_refused(eager("llama", attn="sdpa"), call, BackendError, "'sdpa' attention never forms",
                   'attn_implementation="eager"')
