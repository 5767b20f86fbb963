"""Security: nothing in a spec is ever executed or unpickled, a spec file cannot name code, and remote code in a
checkpoint runs only when the user asks (trust_remote_code is off on both backends).

Refusals of unknown op names, module paths as op names, `__reduce__` fields and pickled blobs are in
tests/test_bad_specs.py; this file adds the rest.
"""

import ast
import asyncio
import base64
import json
import pickle
from pathlib import Path

import pytest
import torch

from interp_engine import Spec, capture, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm.worker import WorkerCall
from interp_engine.errors import InterpEngineError, SpecError
from interp_engine.tiny import build_tiny_model
from tests.conftest import Payload, spec_dict
from tests.skips import requires

PACKAGE = Path(__file__).resolve().parents[1] / "interp_engine"

# ------------------------------------------------------------------------------------------ the source


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            yield node, owner, name


FORBIDDEN = {
    (None, "eval"), (None, "exec"), (None, "compile"), (None, "__import__"), ("importlib", "import_module"),
    ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"), ("cloudpickle", "loads"), ("dill", "loads"),
    ("marshal", "loads"), ("torch", "load"), ("yaml", "load"), ("yaml", "unsafe_load"), (None, "apply_model"),
}


def test_the_package_never_evaluates_imports_or_unpickles_by_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for node, owner, name in _calls(tree):
            if (owner, name) in FORBIDDEN or (None, name) in FORBIDDEN and owner is None:
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {owner or ''}.{name}")
            if name == "apply_model":
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} apply_model (pickled callables)")
            # getattr on a module with a name that is not written in the source: a string from data
            if name == "getattr" and owner is None and isinstance(node.args[0], ast.Name) and \
                    node.args[0].id in ("torch", "builtins", "os", "sys", "importlib") and \
                    not isinstance(node.args[1], ast.Constant):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} getattr({node.args[0].id}, <data>)")
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in text, path
    assert found == []


def test_worker_rpcs_are_named_methods_with_data_arguments():
    """Every call into a vLLM worker names an ie_* method by a constant of wire.py, where each is a literal
    string: no callable crosses over."""
    from interp_engine.backends.vllm import wire

    literal = {node.targets[0].id: node.value.value for node in ast.parse((PACKAGE / "backends/vllm/wire.py")
               .read_text()).body if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)}
    trees = [ast.parse((PACKAGE / f"backends/vllm/{module}.py").read_text()) for module in ("runtime", "weights")]
    names = []
    for node, _, name in (call for tree in trees for call in _calls(tree)):
        if name == "_rpc":
            first = node.args[0]
            assert isinstance(first, ast.Attribute) and isinstance(first.value, ast.Name) and \
                first.value.id == "wire", ast.dump(first)
            value = literal[first.attr]
            assert isinstance(value, str) and value.startswith("ie_") and getattr(wire, first.attr) == value
            names.append(value)
        if name == "collective_rpc":
            assert isinstance(node.args[0], ast.Name) and node.args[0].id == "method"
    assert set(names) == {"ie_attach", "ie_collect", "ie_release", "ie_status", "ie_weights",
                          "ie_put_saes", "ie_saes"} == set(wire.METHODS)


# ------------------------------------------------------------------------------------- specs from disk

def test_a_spec_file_round_trips_from_disk(tmp_path):
    spec = S.Add("resid_post.1", torch.randn(8), scale=2.0, positions=[0, -1]) + S.Ablate("z.0", heads=[1])
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_dict()))
    with path.open() as f:
        again = Spec.from_dict(json.load(f))
    assert again == spec and again.fingerprint() == spec.fingerprint()


@pytest.mark.parametrize("fields", [
    pytest.param({"op": "Add", "point": "resid_post.0", "vector": {"dtype": "os.system", "shape": [1],
                                                                   "data": "AAAAAA=="}}, id="dtype-module-path"),
    pytest.param({"op": "Add", "point": "resid_post.0", "vector": {"dtype": "__class__", "shape": [1],
                                                                   "data": "AAAAAA=="}}, id="dtype-dunder"),
    pytest.param({"op": "Add", "point": "resid_post.0", "vector": {"dtype": "_dynamo", "shape": [1],
                                                                   "data": "AAAAAA=="}}, id="dtype-lazy-submodule"),
    pytest.param({"op": "Add", "point": "resid_post.0", "vector": {"dtype": "Tensor.__reduce_ex__", "shape": [1],
                                                                   "data": "AAAAAA=="}}, id="dtype-method"),
    pytest.param({"op": "Add", "point": "resid_post.0", "vector": {"dtype": ["float32"], "shape": [1],
                                                                   "data": "AAAAAA=="}}, id="dtype-not-a-string"),
    pytest.param({"op": "Ablate", "point": "os.system"}, id="point-module-path"),
    pytest.param({"op": "Ablate", "point": "__import__('os').system('true')"}, id="point-expression"),
    pytest.param({"op": "Ablate", "point": "z.0", "how": "__import__('os')"}, id="how-expression"),
    pytest.param({"op": "Ablate", "point": "z.0", "__class__": "interp_engine.spec.Custom"}, id="class-field"),
    pytest.param({"op": "Custom", "point": "z.0", "fn": "builtins.print"}, id="custom-by-name"),
    pytest.param({"op": "Scale", "point": "z.0", "factor": {"__reduce__": ["os.system", ["true"]]}},
                 id="reduce-as-a-value"),
])
def test_a_spec_file_cannot_name_code(tmp_path, fields):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_dict(**fields)))
    with path.open() as f, pytest.raises(InterpEngineError) as info:
        Spec.from_dict(json.load(f))
    assert "Fix:" in str(info.value)
    with pytest.raises(InterpEngineError):  # the worker reads tables through the same gate
        WorkerCall.from_table({"spec": spec_dict(**fields), "reads": []})
    with pytest.raises(InterpEngineError):  # ... also on its fast path, for tables the driver validated
        WorkerCall.from_table({"spec": spec_dict(**fields), "fingerprint": "0" * 24, "reads": []})


def test_tensor_bytes_are_raw_numbers_never_unpickled(tmp_path):
    marker = tmp_path / "executed"
    blob = pickle.dumps(Payload(marker))
    blob += b"\0" * (-len(blob) % 4)
    raw = spec_dict(op="Set", point="resid_post.0", value={"dtype": "float32", "shape": [len(blob) // 4],
                                                      "data": base64.b64encode(blob).decode()})
    try:
        spec = Spec.from_dict(raw)
        assert spec.ops[0].value.tensor.dtype == torch.float32  # the pickle's bytes, read as floats
    except SpecError as e:
        assert "NaN or +inf" in str(e)  # those bytes happened to spell a NaN: refused as a value, not run
    assert not marker.exists()


def test_dtype_names_come_from_a_fixed_table():
    raw = spec_dict(op="Add", point="resid_post.0", vector={"dtype": "float", "shape": [1], "data": "AACAPw=="})
    assert Spec.from_dict(raw).ops[0].vector.tensor.dtype == torch.float32  # torch's own aliases still read


# ---------------------------------------------------------------------------------- trust_remote_code

@pytest.fixture(scope="module")
def booby_trapped(tmp_path_factory):
    """A Llama checkpoint whose config.json maps the auto classes to a module in the folder; importing that
    module creates a marker file."""
    folder = build_tiny_model("llama", tmp_path_factory.mktemp("trap") / "llama")
    marker = folder.parent / "EXECUTED"
    (folder / "evil.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class EvilConfig(LlamaConfig):\n    pass\n\nclass EvilModel(LlamaForCausalLM):\n    pass\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                          "AutoTokenizer": ["evil.EvilTokenizer", None]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, marker


def test_eager_never_runs_checkpoint_code_unless_asked(booby_trapped):
    folder, marker = booby_trapped
    model = load_model(str(folder), backend="eager", device="cpu")
    assert "trust_remote_code" not in model.runtime.hf_kwargs
    model.runtime.load()
    assert type(model.runtime.model).__module__.startswith("transformers.models.llama")
    assert capture(model, "Hello", ["resid_post.0"])["resid_post.0"].shape[-1] == model.d_model
    assert not marker.exists(), "the checkpoint's code ran"
    asyncio.run(model.shutdown())
    asked = load_model(str(folder), backend="eager", device="cpu", trust_remote_code=True)
    assert asked.runtime.hf_kwargs["trust_remote_code"] is True  # passed on only when the user asks
    assert not marker.exists()


@requires("vllm")
def test_vllm_never_runs_checkpoint_code_unless_asked(booby_trapped):
    folder, marker = booby_trapped
    model = load_model(str(folder), backend="vllm")
    assert "trust_remote_code" not in model.runtime.engine_kwargs
    try:
        asyncio.run(model.warmup())
        assert model.runtime.llm.llm_engine.vllm_config.model_config.trust_remote_code is False
        assert capture(model, "Hello", ["resid_post.0"])["resid_post.0"].shape[-1] == model.d_model
    finally:
        asyncio.run(model.shutdown())
    assert not marker.exists(), "the checkpoint's code ran"
    asked = load_model(str(folder), backend="vllm", extra_vllm_kwargs={"trust_remote_code": True})
    assert asked.runtime.engine_kwargs["trust_remote_code"] is True  # reaches the engine only when asked
