"""Addresses and specs as plain data: parsing, round trips, hashing, fingerprints across processes."""

import json
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from interp_engine import Address, PointError, SpecError
from interp_engine import spec as S
from interp_engine.addresses import POINTS

LAYERED = sorted(p for p, info in POINTS.items() if info.layered)
MODEL_LEVEL = sorted(p for p, info in POINTS.items() if not info.layered)

addresses = st.one_of(
    st.builds(Address, st.sampled_from(LAYERED), st.integers(-64, 63)),
    st.builds(Address, st.sampled_from(MODEL_LEVEL)),
)


@given(addresses)
def test_address_parse_format_round_trip(address):
    assert Address.parse(str(address)) == address
    assert eval(repr(address), {"Address": Address}) == address  # noqa: S307 - our own repr


def test_address_basics():
    assert Address("resid_post", 10) == Address.parse("resid_post.10")
    assert str(Address("logits")) == "logits"
    assert Address("resid_post", -1).resolve(12) == Address("resid_post", 11)
    with pytest.raises(PointError, match="(?s)has 12 layers .*Address\\('resid_post', -1\\)"):
        Address("resid_post", 12).resolve(12)
    with pytest.raises(PointError, match="did you mean 'resid_post'"):
        Address.parse("resid_pots.3")
    with pytest.raises(PointError, match="needs a layer"):
        Address("attn_out")
    with pytest.raises(PointError, match="takes no layer"):
        Address("embed", 0)


vectors = st.integers(1, 6).map(lambda n: torch.randn(n, generator=torch.Generator().manual_seed(n)))
positions = st.one_of(st.just("all"), st.just("last"), st.lists(st.integers(-5, 5), min_size=1, max_size=3),
                      st.builds(slice, st.integers(0, 3), st.none() | st.integers(4, 8), st.none() | st.integers(1, 3)))
ops = st.one_of(
    st.builds(S.Add, addresses, vectors, scale=st.floats(-4, 4), positions=positions),
    st.builds(S.Set, addresses, vectors, positions=positions),
    st.builds(S.Scale, addresses, st.floats(-2, 2), heads=st.none() | st.lists(st.integers(0, 3), min_size=1),
              positions=positions),
    st.builds(S.Ablate, addresses, how=st.sampled_from(["zero", "mean"]), positions=positions),
    st.builds(S.Patch, addresses, vectors, positions=positions),
)


@given(st.lists(ops, max_size=5))
def test_spec_dict_round_trip_and_hash(op_list):
    spec = S.Spec(tuple(op_list))
    again = S.Spec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert again == spec and hash(again) == hash(spec)
    assert again.fingerprint() == spec.fingerprint()


def test_fingerprint_is_stable_across_processes():
    spec = S.Add("resid_post.3", torch.arange(8.0), scale=2.0, positions=[1, -1]) + S.Ablate("z.1", heads=[2])
    code = ("import torch; from interp_engine import spec as S; "
            "print((S.Add('resid_post.3', torch.arange(8.0), scale=2.0, positions=[1, -1]) "
            "+ S.Ablate('z.1', heads=[2])).fingerprint())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == spec.fingerprint()
    changed = S.Spec((S.Add("resid_post.3", torch.arange(8.0) + 1),))
    assert changed.fingerprint() != S.Spec((S.Add("resid_post.3", torch.arange(8.0)),)).fingerprint()


def test_ops_compare_by_content_and_compose():
    a = S.Add("resid_post.1", torch.ones(4))
    assert a == S.Add(Address("resid_post", 1), torch.ones(4)) and hash(a) == hash(S.Add("resid_post.1", torch.ones(4)))
    assert a != S.Add("resid_post.1", torch.ones(4) * 2)
    spec = a + S.Scale("z.0", 0.5) + (S.Ablate("q.0") + S.Set("embed", torch.zeros(4)))
    assert [type(o).__name__ for o in spec] == ["Add", "Scale", "Ablate", "Set"]


def test_from_dict_refuses_anything_but_our_ops():
    with pytest.raises(SpecError, match="unknown op 'os.system'"):
        S.Spec.from_dict({"interp_engine_spec": 1, "ops": [{"op": "os.system", "point": "embed"}]})
    with pytest.raises(SpecError, match="unknown fields"):
        S.Spec.from_dict({"interp_engine_spec": 1, "ops": [{"op": "Scale", "point": "embed", "factor": 2,
                                                           "__reduce__": "x"}]})
    with pytest.raises(SpecError, match="not a spec dict"):
        S.Spec.from_dict({"ops": []})
    with pytest.raises(SpecError, match="cannot be serialised"):
        S.Custom("embed", lambda x: x).__add__(S.Spec()).to_dict()
