"""Property tests (hypothesis): addresses and specs round-trip, fingerprints are the same in every process, and
random valid specs leave nothing behind on either backend (no hook, no worker table, no changed parameter: a
baseline run afterwards is bit-identical)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from interp_engine import Address, Spec, capture, generate, steer
from interp_engine import spec as S
from interp_engine.addresses import POINTS
from interp_engine.arch import Dims, _registry
from interp_engine.validate import feature_shape
from tests.conftest import PROMPTS, assert_pure
from tests.skips import requires

FAST = settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
# Runs of a model: no shrinking (each example is a forward pass; a failure is reported as found, with its ops).
RUNS = settings(deadline=None, max_examples=40, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                # filter_too_much: -inf is refused in vectors, so tensors drawn with one are redrawn on purpose
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])
# The tiny Llama of tests/conftest.py (3 layers, d_model 128, 4 heads, 2 kv heads, d_head 32, d_mlp 256): dense,
# so it lacks the mixture-of-experts points.
LLAMA = _registry()["llama"]
TINY = Dims(n_layers=3, d_model=128, n_heads=4, n_kv_heads=2, d_head=32, d_mlp=256, d_vocab=512, max_len=512)
SHORTEST = 6  # tokens in the shortest of PROMPTS (checked below): random indices stay inside every prompt

# ------------------------------------------------------------------------------------------- strategies


def addresses(n_layers: int | None = None, points=tuple(POINTS)) -> st.SearchStrategy[Address]:
    def build(point: str) -> st.SearchStrategy[Address]:
        if not POINTS[point].layered:
            return st.just(Address(point))
        lo, hi = (-60, 60) if n_layers is None else (-n_layers, n_layers - 1)
        return st.integers(lo, hi).map(lambda layer: Address(point, layer))

    return st.sampled_from(points).flatmap(build)


def one_positions(limit: int = 20) -> st.SearchStrategy:
    index = st.integers(-limit, limit - 1)
    bound = st.none() | st.integers(-limit, limit)
    return st.one_of(st.just("all"), st.just("last"), index, st.lists(index, min_size=1, max_size=4),
                     st.builds(slice, bound, bound, st.none() | st.integers(1, 3)))


def positions(limit: int = 20, prompts: int | None = None) -> st.SearchStrategy:
    count = (1, 4) if prompts is None else (prompts, prompts)
    return one_positions(limit) | st.lists(one_positions(limit), min_size=count[0], max_size=count[1])


finite = st.floats(allow_nan=False, allow_infinity=False, width=32)
storable = st.floats(-6e4, 6e4, width=32)  # finite in every float dtype drawn, float16 included


@st.composite
def tensors(draw, shape: tuple[int, ...] | None = None, dtypes=(torch.float32, torch.float16, torch.bfloat16,
                                                                torch.float64)):
    if shape is None:
        shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    count = 1
    for s in shape:
        count *= s
    values = draw(st.lists(storable | st.sampled_from([0.0, -0.0, float("-inf"), 1e-40]), min_size=count,
                           max_size=count))
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(draw(st.sampled_from(dtypes)))


heads = st.none() | st.lists(st.integers(0, 7), min_size=1, max_size=3)


@st.composite
def any_op(draw):
    """Any op that constructs (shapes and layers need not fit a model: round-trips only)."""
    point, kind = draw(addresses()), draw(st.sampled_from(["Add", "Set", "Scale", "Ablate", "Patch"]))
    where = draw(positions())
    if kind == "Add":
        return S.Add(point, draw(tensors()), scale=draw(finite), positions=where)
    if kind == "Set":
        return S.Set(point, draw(tensors()), positions=where)
    if kind == "Patch":
        return S.Patch(point, draw(tensors()), positions=where)
    if kind == "Scale":
        return S.Scale(point, draw(finite), heads=draw(heads), positions=where)
    return S.Ablate(point, how=draw(st.sampled_from(["zero", "mean"])), heads=draw(heads), positions=where)


specs = st.lists(any_op(), max_size=5).map(lambda ops: Spec(tuple(ops)))


@st.composite
def valid_op(draw, *, eager: bool):
    """An op the tiny Llama accepts on this backend, for a call on PROMPTS."""
    writable = [p for p in POINTS if (eager or not POINTS[p].eager_only_write) and not POINTS[p].read_only
                and not LLAMA.lacks(p)]
    point = draw(addresses(TINY.n_layers, tuple(writable)))
    info = point.info
    where = draw(positions(SHORTEST, prompts=len(PROMPTS)))
    has_heads = info.head_axis is not None
    count = TINY.n_kv_heads if "n_kv_heads" in info.axes else TINY.n_heads
    pick_heads = st.none() | st.lists(st.integers(0, count - 1), min_size=1, max_size=count) if has_heads else \
        st.none()
    kinds = ["Scale", "Ablate"] + ([] if info.pos_axis == 2 else ["Add", "Set"])
    kind = draw(st.sampled_from(kinds))
    if kind in ("Add", "Set"):
        feat = feature_shape(point, TINY, SHORTEST)
        values = draw(tensors(feat, dtypes=(torch.float32,)).filter(lambda t: not bool(t.isneginf().any())))
        values = values.clamp(-4, 4)  # large finite values are valid too, but overflow the tiny model to inf
        if kind == "Add":
            return S.Add(point, values, scale=draw(st.floats(-4, 4)), positions=where)
        return S.Set(point, values, positions=where)
    if kind == "Scale":
        return S.Scale(point, draw(st.floats(-4, 4)), heads=draw(pick_heads), positions=where)
    how = draw(st.sampled_from(["zero", "mean"] if eager else ["zero"]))
    return S.Ablate(point, how=how, heads=draw(pick_heads), positions=where)


# ------------------------------------------------------------------------------------------ round-trips

@FAST
@given(addresses())
def test_address_parse_and_format_round_trip(address):
    assert Address.parse(str(address)) == address
    assert Address.parse(address) is address
    assert str(Address.parse(str(address))) == str(address)
    assert Address.parse(f"  {address}  ") == address


@FAST
@given(specs)
def test_spec_round_trips_through_json(spec):
    data = json.loads(json.dumps(spec.to_dict()))
    again = Spec.from_dict(data)
    assert again == spec
    assert again.fingerprint() == spec.fingerprint()
    assert again.to_dict() == data
    for a, b in zip(spec.ops, again.ops):
        for name in ("vector", "value", "source"):
            if hasattr(a, name):
                x, y = getattr(a, name).tensor, getattr(b, name).tensor
                assert x.dtype == y.dtype and x.shape == y.shape
                assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), "not bit-identical"


@FAST
@given(specs, st.data())
def test_a_different_vector_gives_a_different_fingerprint(spec, data):
    ops = [op for op in spec.ops if isinstance(op, S.Add)]
    if not ops:
        return
    op = ops[0]
    t = op.vector.tensor.clone()
    flat = t.reshape(-1)
    i = data.draw(st.integers(0, flat.numel() - 1))
    flat[i] = 7.0 if float(flat[i]) != 7.0 else 8.0
    changed = Spec(tuple(S.Add(o.point, t, scale=o.scale, positions=o.positions) if o is op else o
                         for o in spec.ops))
    assert changed.fingerprint() != spec.fingerprint()


_FINGERPRINTS = """
import json, sys
from interp_engine import Spec
print(json.dumps([Spec.from_dict(d).fingerprint() for d in json.load(sys.stdin)]))
"""


@settings(deadline=None, max_examples=2)
@given(st.lists(specs, min_size=40, max_size=40))
def test_fingerprints_are_the_same_in_another_process(batch):
    here = [s.fingerprint() for s in batch]
    env = {**os.environ, "PYTHONHASHSEED": "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"}
    out = subprocess.run([sys.executable, "-c", _FINGERPRINTS], input=json.dumps([s.to_dict() for s in batch]),
                         capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == here


# ------------------------------------------------------------------------------- nothing is left behind

def test_the_prompts_are_as_long_as_the_strategies_assume(eager):
    assert min(len(eager("llama").tokenize(p)) for p in PROMPTS) == SHORTEST


@pytest.fixture(scope="module")
def untouched(eager):
    """The eager Llama with its parameters and baseline logits as they were before any example ran."""
    model = eager("llama")
    params = [p.detach().clone() for p in model.runtime.model.parameters()]
    with torch.inference_mode():
        logits = model.runtime.model(input_ids=torch.tensor([model.tokenize(PROMPTS[0])])).logits.clone()
    return model, params, logits


@RUNS
@given(st.lists(valid_op(eager=True), min_size=1, max_size=4), st.sampled_from(["capture", "steer", "generate"]))
def test_random_valid_specs_leave_the_eager_model_untouched(untouched, ops, verb):
    model, params, logits = untouched
    spec = Spec(tuple(ops))
    if verb == "capture":
        capture(model, PROMPTS, ["resid_post.2", "attn_probs.1", "v.0"], spec, progress=False)
    elif verb == "steer":
        steer(model, PROMPTS, spec, progress=False)
    elif not any(op.point.info.needs_eager_attention for op in ops):
        generate(model, PROMPTS, spec, max_new_tokens=2, stop_at_eos=False, progress=False)
    assert_pure(model, params, logits)  # no hook on any module, parameters and baseline logits bit-identical


@pytest.fixture(scope="module")
def served(served_llama):
    return served_llama, steer(served_llama, PROMPTS, Spec(), progress=False)


@requires("vllm")
@settings(RUNS, max_examples=12)
@given(st.lists(valid_op(eager=False), min_size=1, max_size=4), st.sampled_from(["capture", "steer", "generate"]))
def test_random_valid_specs_leave_no_worker_table_on_vllm(served, ops, verb):
    model, baseline = served
    spec = Spec(tuple(ops))
    if verb == "capture":
        capture(model, PROMPTS, ["resid_post.2", "attn_probs.1", "v.0"], spec, progress=False)
    elif verb == "steer":
        steer(model, PROMPTS, spec, progress=False)
    else:
        generate(model, PROMPTS, spec, max_new_tokens=2, stop_at_eos=False, progress=False)
    assert model.runtime.worker_status() == [{"calls": 0, "hooks": 0}]
    assert torch.equal(steer(model, PROMPTS, Spec(), progress=False), baseline)
