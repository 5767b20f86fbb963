"""Every bad input gets one clear error naming the fix, raised before any forward pass; the handle still works."""

import base64
import contextlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from interp_engine import Address, Spec, capture, load_model, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError, InputTypeError, InterpEngineError, LoadError, PointError, SpecError

PROMPT = "Hello, world! Tell me a story"


def _tokens(model):
    return model.to_tokens(PROMPT)


@contextlib.contextmanager
def forward_calls(model):
    """Counts forward passes of the HF model; the hook is gone on exit, so the purity check still holds."""
    calls: list[int] = []
    hook = model.runtime.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def assert_still_works(model) -> None:
    tokens = _tokens(model)
    cache = capture(model, tokens, ["resid_post.0"], progress=False)
    assert cache["resid_post.0"].shape == (1, tokens.shape[1], model.d_model)


def assert_refused(model, call, error: type, *fragments: str) -> str:
    """`call(model)` raises `error` naming the fix and every fragment, with no forward pass; the handle works."""
    with forward_calls(model) as calls, pytest.raises(error) as info:
        call(model)
    message = str(info.value)
    assert isinstance(info.value, InterpEngineError)
    assert "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert not calls, "a forward pass ran before the error"
    assert_still_works(model)
    return message


# ------------------------------------------------------------------------------ requests on a loaded handle

def test_the_forward_counter_sees_a_forward_pass(eager):
    model = eager("llama")
    with forward_calls(model) as calls:
        capture(model, _tokens(model), ["resid_post.0"], progress=False)
    assert calls == [1]


REQUESTS = [
    pytest.param(lambda m: capture(m, _tokens(m), ["resid_pots.0"]), PointError,
                 ("'resid_pots' is not a point", "did you mean 'resid_post'?"), id="unknown-point"),
    pytest.param(lambda m: capture(m, _tokens(m), [Address("resid_post", 5)]), PointError,
                 ("resid_post.5 does not exist", "3 layers (0..2)", "Address('resid_post', -1)"),
                 id="layer-out-of-range"),
    pytest.param(lambda m: capture(m, _tokens(m), ["z.-4"]), PointError,
                 ("z.-4 does not exist", "3 layers (0..2)", "use z.2"), id="negative-layer-out-of-range"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", torch.randn(7))), SpecError,
                 ("vector has shape (7,)", "resid_post holds (128,) per position"), id="vector-shape"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("mlp_act.1", torch.randn(128))), SpecError,
                 ("vector has shape (128,)", "mlp_act holds (256,) per position"), id="vector-shape-d_mlp"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", torch.ones(128, dtype=torch.long))),
                 SpecError, ("dtype torch.int64", "floating-point", "vector.float()"), id="int-vector"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", torch.full((128,), float("nan")))),
                 SpecError, ("NaN", "torch.nan_to_num(vector)"), id="nan-vector"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", torch.randn(128), scale=float("inf"))),
                 SpecError, ("Add.scale is inf", "finite scale"), id="inf-scale"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", [0.0] * 128)), InputTypeError,
                 ("vector must be a torch.Tensor", "torch.tensor(...)"), id="vector-as-list"),
    pytest.param(lambda m: run_with_grad(m, _tokens(m), loss=lambda logits: logits.sum(), wrt=["resid_post.0"]),
                 BackendError, ("loaded without them", "requires_grad=True"), id="grad-without-requires_grad"),
    pytest.param(lambda m: capture(m, [], ["resid_post.0"]), SpecError,
                 ("prompts is empty", "at least one prompt"), id="empty-prompt-list"),
    pytest.param(lambda m: capture(m, torch.zeros((1, 0), dtype=torch.long), ["resid_post.0"]), SpecError,
                 ("prompt 0 has no tokens",), id="prompt-without-tokens"),
    pytest.param(lambda m: capture(m, torch.tensor([[1, 2, 10**6]]), ["resid_post.0"]), SpecError,
                 ("outside the vocabulary", "[1000000]", "model.to_tokens(text)"), id="token-past-vocab"),
    pytest.param(lambda m: capture(m, [[1, -3, 2]], ["resid_post.0"]), SpecError,
                 ("outside the vocabulary", "[-3]"), id="negative-token-id"),
    pytest.param(lambda m: capture(m, _tokens(m), ["resid_post.0"], batch_size=0), InputTypeError,
                 ("batch_size=0", "batch_size=16"), id="zero-batch-size"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Scale("q.0", 2.0, heads=[7])), PointError,
                 ("heads [7] at q.0 do not exist", "q has 4 heads", "0..3"), id="heads-out-of-range"),
    # k has n_kv_heads (2), not n_heads (4): a head valid for q is out of range here.
    pytest.param(lambda m: steer(m, _tokens(m), S.Ablate("k.1", heads=[3])), PointError,
                 ("k has 2 heads", "0..1"), id="kv-heads-out-of-range"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Scale("resid_post.0", 2.0, heads=[0])), SpecError,
                 ("resid_post has no head axis", "drop heads="), id="heads-on-point-without-heads"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Add("resid_post.0", torch.randn(128), positions=[50])),
                 SpecError, ("positions [50]", "past the end of every prompt"), id="positions-past-the-end"),
    pytest.param(lambda m: steer(m, [PROMPT, "Paris is"], S.Add("resid_post.0", torch.randn(128),
                                                               positions=[[0], [1], [0]])),
                 SpecError, ("3 entries for 2 prompts", "one positions entry per prompt"),
                 id="per-prompt-positions-wrong-count"),
]


@pytest.mark.parametrize("call, error, fragments", REQUESTS)
def test_bad_request_refused_before_forward(eager, call, error, fragments):
    assert_refused(eager("llama"), call, error, *fragments)


def test_errors_are_also_builtin_exceptions(eager):
    model = eager("llama")
    with pytest.raises(LookupError):
        capture(model, _tokens(model), ["resid_pots.0"])
    with pytest.raises(ValueError):
        steer(model, _tokens(model), S.Add("resid_post.0", torch.randn(7)))
    with pytest.raises(NotImplementedError):
        run_with_grad(model, _tokens(model), loss=lambda logits: logits.sum(), wrt=["resid_post.0"])


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
    assert_refused(model, lambda m: steer(m, _tokens(m), spec), SpecError, "(256,)", "(128,)", "resid_post.1")


def test_several_problems_are_listed_at_once_and_numbered(eager):
    spec = (S.Add("resid_post.0", torch.randn(7)) + S.Scale("q.9", 2.0) + S.Ablate("z.0", heads=[11]))
    message = assert_refused(eager("llama"), lambda m: steer(m, _tokens(m), spec), SpecError,
                             "3 problems with this request (nothing was run)")
    lines = message.splitlines()
    numbered = [line for line in lines if line[:3] in ("1. ", "2. ", "3. ")]
    assert [line[:3] for line in numbered] == ["1. ", "2. ", "3. "], message
    assert "(7,)" in numbered[0] and "q.9" in numbered[1] and "heads [11]" in numbered[2]
    assert message.count("Fix:") == 3


@pytest.mark.parametrize("call", [
    pytest.param(lambda m: capture(m, _tokens(m), ["attn_probs.0"]), id="capture-attn_probs"),
    pytest.param(lambda m: capture(m, _tokens(m), ["attn_scores.2"]), id="capture-attn_scores"),
    pytest.param(lambda m: steer(m, _tokens(m), S.Ablate("attn_probs.1", heads=[0])), id="edit-attn_probs"),
])
def test_attention_patterns_need_eager_attention(eager, call):
    assert_refused(eager("llama", attn="sdpa"), call, BackendError, "'sdpa' attention never forms",
                   'attn_implementation="eager"')


# ------------------------------------------------------------------------------------- specs read from data

class _Payload:
    """Unpickling this creates `path`: proof that something was executed."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _spec_dict(**op) -> dict:
    return {"interp_engine_spec": 1, "ops": [op]}


@pytest.mark.parametrize("op_name", ["Evil", "os.system", "builtins.eval", "interp_engine.spec.Custom",
                                     "pathlib.Path.touch"])
def test_spec_from_dict_refuses_unknown_ops_and_module_paths(eager, tmp_path, op_name):
    marker = tmp_path / "executed"
    raw = _spec_dict(op=op_name, point="resid_post.0", fn="pathlib.Path.touch", args=[str(marker)])
    with pytest.raises(SpecError) as info:
        Spec.from_dict(raw)
    assert f"unknown op {op_name!r}" in str(info.value)
    assert "Fix: use one of Add, Set, Scale, Ablate, Patch" in str(info.value)
    assert not marker.exists()
    assert_still_works(eager("llama"))


def test_spec_from_dict_refuses_unknown_fields(tmp_path):
    good = Spec((S.Add("resid_post.0", torch.randn(128)),)).to_dict()
    good["ops"][0]["__reduce__"] = "os.system"
    with pytest.raises(SpecError, match=r"unknown fields \['__reduce__'\]"):
        Spec.from_dict(good)


def test_spec_from_dict_never_unpickles(tmp_path):
    marker = tmp_path / "executed"
    blob = pickle.dumps(_Payload(marker))
    for raw in (blob, {"interp_engine_spec": 1, "ops": [blob]}):
        with pytest.raises(SpecError) as info:
            Spec.from_dict(raw)
        assert "Fix:" in str(info.value)
    assert not marker.exists()


def _corrupt(change) -> dict:
    raw = json.loads(json.dumps(Spec((S.Add("resid_post.0", torch.randn(128)),)).to_dict()))
    change(raw["ops"][0])
    return raw


@pytest.mark.parametrize("change", [
    pytest.param(lambda op: op["vector"].update(data=base64.b64encode(b"x" * 60).decode()), id="truncated-data"),
    pytest.param(lambda op: op["vector"].update(shape=[64]), id="shape-disagrees-with-data"),
    pytest.param(lambda op: op.pop("point"), id="missing-field"),
    pytest.param(lambda op: op.update(vector="abc"), id="tensor-not-a-dict"),
    pytest.param(lambda op: op["vector"].update(data="not base64!"), id="bad-base64"),
    pytest.param(lambda op: op.update(positions={"slice": "x"}), id="bad-slice"),
])
def test_spec_from_dict_refuses_malformed_ops_with_a_fix(change):
    with pytest.raises(SpecError, match="Fix:"):
        Spec.from_dict(_corrupt(change))


# ------------------------------------------------------------------------------------------- load_model

def assert_load_refused(eager, error: type, fragments: tuple[str, ...], repo, **kwargs) -> str:
    with pytest.raises(error) as info:
        load_model(repo, **kwargs)
    message = str(info.value)
    assert isinstance(info.value, InterpEngineError)
    assert "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert_still_works(eager("llama"))
    return message


@pytest.mark.parametrize("backend, nearest", [("egaer", "eager"), ("vllm_static", "vllm-static"),
                                              ("vllm-gen", "vllm-generate"), ("vlm", "vllm")])
def test_unknown_backend_suggests_the_nearest(eager, tiny_path, backend, nearest):
    assert_load_refused(eager, BackendError, (f"backend={backend!r} is not a backend", f"did you mean {nearest!r}?"),
                        str(tiny_path("llama")), backend=backend)


def test_unknown_architecture_refused_before_loading(eager, tmp_path):
    from transformers import BloomConfig

    # config.json only, no weights: reaching the error at all proves it came before any load.
    BloomConfig().save_pretrained(str(tmp_path))
    assert_load_refused(eager, LoadError, ("a 'bloom' model", "does not cover", "llama", "gpt2"),
                        str(tmp_path), backend="eager")


def test_fp8_on_eager_names_vllm_or_an_fp8_repo(eager, tiny_path):
    assert_load_refused(eager, BackendError, ("quantization='fp8' cannot be applied on backend='eager'",
                                              'use a vLLM backend (backend="vllm"), or a repo that ships in FP8'),
                        str(tiny_path("llama")), backend="eager", quantization="fp8")


def test_unknown_quantization_scheme_suggests_the_nearest(eager, tiny_path):
    assert_load_refused(eager, SpecError, ("quantization='fp9'", "did you mean 'fp8'?"),
                        str(tiny_path("llama")), backend="eager", quantization="fp9")


@pytest.mark.parametrize("keyword, value", [
    ("kv_cache_dtype", "fp8"), ("static_points", "auto"), ("static_writes", ["resid_post.1"]),
    ("gpu_memory_utilization", 0.85), ("max_model_len", 4096), ("extra_vllm_kwargs", {"enable_prefix_caching": False}),
])
def test_vllm_only_keywords_refused_on_eager(eager, tiny_path, keyword, value):
    assert_load_refused(eager, BackendError, (f"{keyword}= is a vLLM setting", f"drop {keyword}= for eager"),
                        str(tiny_path("llama")), backend="eager", **{keyword: value})


@pytest.mark.parametrize("num_gpus, fragment", [
    (0, "num_gpus=0: it counts GPUs"),
    (-1, "num_gpus=-1: it counts GPUs"),
    pytest.param(2, "num_gpus=2 but", marks=pytest.mark.skipif(
        torch.cuda.device_count() >= 2, reason="two CUDA devices are visible, so num_gpus=2 is valid here")),
])
def test_bad_num_gpus_refused(eager, tiny_path, num_gpus, fragment):
    assert_load_refused(eager, SpecError, (fragment,), str(tiny_path("llama")), backend="eager", num_gpus=num_gpus)


def test_bad_attn_implementation_suggests_eager(eager, tiny_path):
    assert_load_refused(eager, SpecError, ("attn_implementation='egar'", "did you mean 'eager'?"),
                        str(tiny_path("llama")), backend="eager", attn_implementation="egar")


def test_requires_grad_must_be_a_bool(eager, tiny_path):
    assert_load_refused(eager, InputTypeError, ("requires_grad must be True or False",),
                        str(tiny_path("llama")), backend="eager", requires_grad="yes")


@pytest.mark.parametrize("repo", ["tiny-org/not-cached", "./no/such/folder"])
def test_missing_folder_or_uncached_repo_says_no_download(eager, offline_hub, repo):
    assert_load_refused(eager, LoadError, (f"{repo!r} is neither a local folder nor in the local HF cache",
                                           "never downloads", "pass a local folder path"), repo, backend="eager")


def test_folder_without_config_json(eager, tmp_path):
    assert_load_refused(eager, LoadError, ("has no config.json", "save_pretrained()"), str(tmp_path),
                        backend="eager")
