"""Random JSON, tensors and keywords thrown at Spec.from_dict, capture, steer, generate and load_harvest: only the
library's errors (InterpEngineError subclasses) or valid results come out (issue 19, Deliver).

Examples per test: HOSTILE_EXAMPLES (eager and load_harvest, default 150) and HOSTILE_VLLM_EXAMPLES (default 25).
"""

import base64
import json
import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interp_engine import Spec, capture, generate, load_harvest, steer
from interp_engine.errors import InterpEngineError
from tests.skips import requires

EXAMPLES = int(os.environ.get("HOSTILE_EXAMPLES", "150"))
VLLM_EXAMPLES = int(os.environ.get("HOSTILE_VLLM_EXAMPLES", "25"))
# Derandomized (the same examples every run) unless HOSTILE_RANDOM is set, to hunt for new failures.
SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck),
                derandomize=os.environ.get("HOSTILE_RANDOM") is None)

POINTS = ["resid_post.0", "resid_pre.2", "resid_post.-1", "attn_out.1", "mlp_out.0", "mlp_act.1", "q.0", "k.1", "z.2",
          "attn_scores.0", "attn_probs.1", "logits", "embed", "resid_post.3", "blocks.1.hook_resid_post",
          "blocks.99999999999.hook_resid_post", "resid_post." + "9" * 30, "nope.1", "", "resid_post.x"]
HUGE_INTS = st.sampled_from([2**31 - 1, 2**31, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**400, -10**400])
INTS = st.one_of(st.integers(-5, 600), HUGE_INTS)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e308, -1e-308]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
DTYPES = ["float32", "float16", "bfloat16", "float64", "float", "half", "float8_e4m3fn", "int64", "bool",
          "complex64", "torch.float32", ""]
SHAPES = st.lists(st.one_of(st.sampled_from([0, 1, 2, 4, 128, 512]), HUGE_INTS), max_size=4)


@st.composite
def tensor_dicts(draw):
    dtype, shape = draw(st.sampled_from(DTYPES)), draw(SHAPES)
    if draw(st.booleans()) and all(0 <= s <= 512 for s in shape) and math.prod(shape) <= 1 << 16:
        size = math.prod(shape) * 4  # right for float32, a length mismatch for the others
        data = base64.b64encode(os.urandom(size) if draw(st.booleans()) else bytes(size)).decode()
    else:
        data = draw(st.one_of(st.text(max_size=16), st.just("AAAA" * 32), JSON))
    d = {"dtype": dtype, "shape": shape, "data": data}
    if draw(st.booleans()):
        d = draw(st.one_of(st.just({**d, "extra": 1}), JSON.map(lambda v: {"dtype": dtype, "shape": v, "data": data})))
    return d


POSITIONS = st.one_of(st.sampled_from(["all", "last", "first", None, True]), INTS, st.lists(INTS, max_size=3),
                      st.builds(lambda a, b, c: {"slice": [a, b, c]}, st.one_of(st.none(), INTS),
                                st.one_of(st.none(), INTS), st.one_of(st.none(), INTS)),
                      st.builds(lambda e: {"per_prompt": e}, st.lists(st.one_of(st.sampled_from(["all", "last"]), INTS,
                                                                              st.lists(INTS, max_size=2)), max_size=3)),
                      JSON)


@st.composite
def op_dicts(draw):
    kind = draw(st.sampled_from(["Add", "Set", "Scale", "Ablate", "Patch", "Custom", "os.system", 3]))
    op = {"op": kind, "point": draw(st.one_of(st.sampled_from(POINTS), JSON))}
    fields = {"vector": tensor_dicts(), "value": tensor_dicts(), "source": tensor_dicts(), "factor": FLOATS | INTS,
              "scale": FLOATS | INTS, "heads": st.one_of(st.lists(INTS, max_size=3), INTS, JSON),
              "how": st.sampled_from(["zero", "mean", "max"]), "positions": POSITIONS, "junk": JSON}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        op[name] = draw(fields[name])
    return op


SPEC_DICTS = st.one_of(
    st.builds(lambda ops: {"interp_engine_spec": 1, "ops": ops}, st.lists(op_dicts(), max_size=3)),
    st.builds(lambda ops, extra: {"interp_engine_spec": 1, "ops": ops, **extra}, st.lists(op_dicts(), max_size=2),
              st.dictionaries(st.text(max_size=6), JSON, max_size=2)),
    JSON)


def _torch_dtype(name):
    return {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64, "bf16": torch.bfloat16,
            "f8": torch.float8_e4m3fn, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool,
            "complex": torch.complex64}[name]


@st.composite
def tensors(draw):
    shape = draw(st.lists(st.sampled_from([0, 1, 2, 3, 128]), max_size=3))
    dtype = _torch_dtype(draw(st.sampled_from(["float32", "float16", "float64", "bf16", "f8", "int64", "int32",
                                               "bool", "complex"])))
    t = torch.randn(shape).mul(draw(st.sampled_from([1.0, 1e30, float("nan"), float("inf")])))
    return t.to(dtype) if dtype != torch.bool else t > 0


PROMPTS = st.one_of(
    st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3),
    st.lists(st.lists(st.one_of(INTS, st.booleans(), FLOATS, st.lists(INTS, max_size=2)), max_size=5), max_size=3),
    tensors(), st.lists(tensors(), max_size=2), JSON)
SPECS = st.one_of(SPEC_DICTS.map(lambda d: ("json", d)), tensors().map(lambda t: ("add", t)))
KEYWORDS = st.fixed_dictionaries({}, optional={
    "batch_size": st.one_of(INTS, FLOATS, st.booleans()), "max_new_tokens": INTS,
    "temperature": st.one_of(FLOATS, INTS), "top_k": st.one_of(INTS, st.none()), "top_p": st.one_of(FLOATS, st.none()),
    "seed": st.one_of(INTS, st.none(), FLOATS), "stop_at_eos": st.one_of(st.booleans(), INTS), "sepc": JSON})


def _spec(kind_value):
    from interp_engine import spec as S

    kind, value = kind_value
    if kind == "add":
        return S.Add("resid_post.0", value)
    return Spec.from_dict(value)


def _library_error_or_result(call) -> None:
    try:
        call()
    except InterpEngineError as e:
        assert "Fix:" in str(e) or "problems with this request" in str(e), str(e)


def _throw(model, data) -> None:
    verb = data.draw(st.sampled_from(["from_dict", "capture", "steer", "generate"]))
    if verb == "from_dict":
        _library_error_or_result(lambda: Spec.from_dict(data.draw(SPEC_DICTS)))
        return
    prompts, spec_value = data.draw(PROMPTS), data.draw(SPECS)
    points = data.draw(st.one_of(st.lists(st.one_of(st.sampled_from(POINTS), JSON), max_size=3), JSON))
    keywords = data.draw(KEYWORDS)
    if verb == "capture":
        keywords = {k: v for k, v in keywords.items() if k in ("batch_size", "sepc")}
        _library_error_or_result(lambda: capture(model, prompts, points, spec=_spec(spec_value), progress=False,
                                                 **keywords))
    elif verb == "steer":
        keywords = {k: v for k, v in keywords.items() if k == "batch_size"}
        _library_error_or_result(lambda: steer(model, prompts, _spec(spec_value), progress=False, **keywords))
    else:
        if isinstance(keywords.get("max_new_tokens"), int) and keywords["max_new_tokens"] > 8:
            keywords["max_new_tokens"] = 8  # a long generation proves nothing more and costs time
        _library_error_or_result(lambda: generate(model, prompts, _spec(spec_value), progress=False, **keywords))


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(data=st.data())
def test_only_library_errors_come_out_on_eager(eager, data):
    _throw(eager("llama"), data)


@requires("vllm")
@settings(max_examples=VLLM_EXAMPLES, **SETTINGS)
@given(data=st.data())
def test_only_library_errors_come_out_on_vllm(served_llama, data):
    _throw(served_llama, data)
    assert served_llama.runtime.is_alive()


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(manifest=st.one_of(JSON, st.builds(lambda extra: {"format": "interp_engine.harvest/2", **extra},
                                          st.dictionaries(st.sampled_from(["model", "points", "shards", "dtype",
                                                                           "n_prompts", "complete", "shapes"]),
                                                          JSON, max_size=7))),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_only_library_errors_come_out_of_load_harvest(tmp_path_factory, manifest, raw):
    folder = tmp_path_factory.mktemp("harvest")
    (folder / "manifest.json").write_bytes(raw if raw is not None else json.dumps(manifest).encode())
    _library_error_or_result(lambda: load_harvest(folder))
