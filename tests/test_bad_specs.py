"""Specs read from data (`Spec.from_dict`): unknown ops, module paths and fields, pickles and malformed ops are
refused with a Fix: line, and nothing is executed or unpickled (test_security.py adds the rest)."""

import base64
import json
import pickle

import pytest
import torch

from interp_engine import Spec
from interp_engine import spec as S
from interp_engine.errors import SpecError
from tests.conftest import Payload, spec_dict
from tests.refusals import assert_still_works


@pytest.mark.parametrize("op_name", ["Evil", "os.system", "builtins.eval", "interp_engine.spec.Custom",
                                     "pathlib.Path.touch"])
def test_spec_from_dict_refuses_unknown_ops_and_module_paths(eager, tmp_path, op_name):
    marker = tmp_path / "executed"
    raw = spec_dict(op=op_name, point="resid_post.0", fn="pathlib.Path.touch", args=[str(marker)])
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
    blob = pickle.dumps(Payload(marker))
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
