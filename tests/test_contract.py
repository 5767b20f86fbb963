"""The backend contract: backend names are compared only in selection.py and backends/, every runtime satisfies
the `Runtime` protocol, and each backend's `Capabilities` answers what `validate.plan` does."""

import ast
import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import interp_engine
from interp_engine import BackendError, InterpEngineError, load_model
from interp_engine.addresses import POINTS, Address
from interp_engine.backends import REGISTRY, GradientRuntime, Runtime, capabilities, serving
from interp_engine.backends.base import VERBS
from interp_engine.backends.eager.capabilities import for_handle as eager_handle
from interp_engine.backends.vllm.capabilities import for_handle as vllm_handle
from interp_engine.spec import Add, as_spec
from interp_engine.taps import Taps
from interp_engine.validate import feature_shape, plan
from tests.skips import requires

NAMES = frozenset({"eager", "vllm", "vllm-static", "vllm-generate"})
TABLES = frozenset({"BACKENDS", "VLLM_BACKENDS", "SERVED_BY"})  # backend-name tables of selection.py (and of old)
PACKAGE = Path(interp_engine.__file__).parent


# ------------------------------------------------------------------------------------------ the source scan

def _is_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in NAMES


def _names_a_backend(node: ast.AST) -> bool:
    """A backend name, a literal collection holding one, or a backend-name table."""
    if _is_name(node):
        return True
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_backend(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _names_a_backend(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        return any(_names_a_backend(a) for a in node.args)
    return isinstance(node, ast.Name | ast.Attribute) and getattr(node, "id", getattr(node, "attr", None)) in TABLES


def backend_name_decisions(source: str) -> list[tuple[int, str]]:
    """(line, what) for every place `source` decides by backend name: a comparison (==, !=, in, not in, is)
    or a match case against a name or a collection of names, a literal table holding names (a tuple, list,
    set or dict, e.g. {"capture": ("eager", "vllm")}), or a use of a backend-name table."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_a_backend, [node.left, *node.comparators])):
            found.append((node.lineno, "compares against a backend name"))
        elif isinstance(node, ast.MatchValue) and _is_name(node.value):
            found.append((node.lineno, "matches a backend name"))
        elif isinstance(node, ast.Tuple | ast.List | ast.Set) and any(map(_is_name, node.elts)):
            found.append((node.lineno, "holds backend names in a table"))
        elif isinstance(node, ast.Dict) and any(map(_names_a_backend, [k for k in node.keys if k] + node.values)):
            found.append((node.lineno, "holds backend names in a table"))
        elif isinstance(node, ast.Name) and node.id in TABLES:
            found.append((node.lineno, f"uses the backend-name table {node.id}"))
        elif isinstance(node, ast.ImportFrom) and any(a.name in TABLES for a in node.names):
            found.append((node.lineno, "imports a backend-name table"))
    return sorted(set(found))


def _exempt(path: Path) -> bool:
    relative = path.relative_to(PACKAGE).as_posix()
    return relative == "selection.py" or relative.startswith("backends/")


def test_no_backend_name_decisions_outside_selection_and_backends():
    """What a backend can do is asked of its Capabilities; error messages may still name backends."""
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
             for path in sorted(PACKAGE.rglob("*.py")) if not _exempt(path)
             for line, what in backend_name_decisions(path.read_text())]
    assert not found, "backend names decided on outside selection.py and backends/:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    'if model.backend == "eager": pass',
    'if backend != "vllm-static": pass',
    'ok = backend in ("vllm", "vllm-static")',
    'ok = backend not in {"vllm-generate"}',
    'ok = backend in VLLM_BACKENDS',
    'from interp_engine.selection import VLLM_BACKENDS',
    'SERVED_BY = {"capture": ("eager", "vllm")}',
    'SCHEMES = {"fp8": VLLM_BACKENDS, "bnb-8bit": ("eager",)}',
    'where = ("eager", *others)',
    'match backend:\n    case "vllm": pass',
    'ok = model.attn_implementation != "eager"',
], ids=lambda s: s.splitlines()[0][:40])
def test_the_scan_catches_each_way_the_code_once_decided_by_name(source):
    assert backend_name_decisions(source), source


@pytest.mark.parametrize("source", [
    'raise BackendError(fix("no", \'use backend="eager".\'))',
    'load_model(path, backend="vllm")',
    'def estimate(*, backend: str = "vllm"): pass',
    'note = f"backend={backend!r}"',
])
def test_the_scan_lets_messages_and_arguments_name_backends(source):
    assert backend_name_decisions(source) == []


def test_importing_the_registry_never_imports_vllm():
    code = ("import sys, interp_engine, interp_engine.backends, interp_engine.sizing, interp_engine.cli; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=PACKAGE.parent)


# ------------------------------------------------------------------------------------------ the Runtime protocol

_METHODS = ("load", "unload", "tokenize", "decode", "forward", "stream", "generate", "lens")


def _takes_what_the_protocol_passes(runtime, protocol: type, name: str) -> None:
    """Every call the protocol allows binds to the runtime's method (its required keywords included)."""
    declared = inspect.signature(getattr(protocol, name))
    actual = inspect.signature(getattr(runtime, name))
    params = [p for p in declared.parameters.values() if p.name != "self"]
    args = [object() for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    kwargs = {p.name: object() for p in params if p.kind is p.KEYWORD_ONLY}
    actual.bind(*args, **kwargs)  # raises TypeError if the runtime's method does not take the protocol's call


def _check_runtime(model) -> None:
    runtime = model.runtime
    assert isinstance(runtime, Runtime), type(runtime)
    for name in _METHODS:
        _takes_what_the_protocol_passes(runtime, Runtime, name)
    assert isinstance(runtime, GradientRuntime) == model.capabilities.gradients
    if model.capabilities.gradients:
        _takes_what_the_protocol_passes(runtime, GradientRuntime, "forward_with_grad")
    assert isinstance(runtime.pad_id, int) and model.capabilities is runtime.capabilities
    assert model.capabilities.backend == model.backend


def test_the_eager_runtime_satisfies_the_protocol(eager):
    _check_runtime(eager("llama", "sdpa"))
    _check_runtime(eager("llama", grad=True))


@requires("vllm")
@pytest.mark.parametrize("backend", ["vllm", "vllm-static", "vllm-generate"])
def test_the_vllm_runtime_satisfies_the_protocol(tiny_path, backend):
    model = load_model(str(tiny_path("llama")), backend=backend)  # lazy: no engine starts
    _check_runtime(model)
    assert not model.is_loaded


# ------------------------------------------------------------------------------------------ Capabilities

def test_the_registry_declares_each_backend():
    assert list(REGISTRY) == ["eager", "vllm", "vllm-static", "vllm-generate"]
    assert capabilities("eager").verbs == frozenset(VERBS)
    assert serving("run_with_grad") == ("eager",) and serving("generate") == tuple(REGISTRY)
    assert serving("capture") == serving("steer") == serving("logit_lens") == ("eager", "vllm", "vllm-static")
    assert [c.vllm_engine for c in REGISTRY.values()] == [False, True, True, True]
    assert [c.declares_taps for c in REGISTRY.values()] == [False, False, True, False]
    assert capabilities("eager").quantization == {"bnb-4bit", "bnb-8bit"}
    assert all(c.quantization == {"fp8", "bnb-4bit"} for c in REGISTRY.values() if c.vllm_engine)
    assert not capabilities("vllm-generate").points
    with pytest.raises(dataclasses.FrozenInstanceError):
        capabilities("eager").gradients = False  # type: ignore[misc]


def _handle(model, value):
    """`model` as if loaded with these capabilities (validate reads nothing else of the runtime)."""
    return dataclasses.replace(model, backend=value.backend, runtime=SimpleNamespace(capabilities=value),
                               attn_implementation=value.attn_implementation or "vllm", taps=value.taps)


def _accepted(model, *, read: Address | None = None, write: Address | None = None) -> bool:
    longest = 4
    ops = []
    if write is not None:
        feat = feature_shape(write, model.dims, longest)
        shape = (1, feat[0], longest, longest) if write.info.pos_axis == 2 else feat
        ops = [Add(write, torch.zeros(shape))]
    try:
        plan(model, as_spec(ops), [read] if read is not None else [], n_prompts=1, longest=longest)
    except InterpEngineError:
        return False
    return True


def _grid(n_layers: int) -> list[Address]:
    return [Address(p, layer) if info.layered else Address(p) for p, info in POINTS.items()
            for layer in (range(n_layers) if info.layered else [None])]


def _values(n_layers: int):
    taps = Taps.of(["resid_post.1", "attn_probs.0", "mlp_act.2"], ["resid_post.0", "q.1"], n_layers)
    return {"eager-sdpa": eager_handle("sdpa"), "eager-eager": eager_handle("eager"),
            "vllm": vllm_handle("vllm", None), "vllm-static": vllm_handle("vllm-static", taps),
            "vllm-generate": vllm_handle("vllm-generate", None)}


@pytest.mark.parametrize("which", ["eager-sdpa", "eager-eager", "vllm", "vllm-static", "vllm-generate"])
def test_capabilities_answer_what_validate_does(eager, which):
    """For every point of a tiny model, can_read / can_write agree with what validate.plan accepts."""
    base = eager("llama")
    value = _values(base.n_layers)[which]
    model = _handle(base, value)
    assert model.capabilities is value
    # Capabilities are the backend's; the points a family has are the model's (validate asks its arch).
    for address in (a for a in _grid(base.n_layers) if not base.arch.lacks(a.point)):
        assert value.can_read(address) == _accepted(model, read=address), (which, "read", address)
        assert value.can_write(address) == _accepted(model, write=address), (which, "write", address)


def test_examples_of_what_each_handle_refuses(eager):
    base = eager("llama")
    values = _values(base.n_layers)
    probs, logits = Address("attn_probs", 0), Address("logits")
    assert not values["eager-sdpa"].can_read(probs) and values["eager-eager"].can_read(probs)
    assert values["eager-eager"].can_write(logits) and not values["vllm"].can_write(logits)
    static = values["vllm-static"]
    assert static.can_write(Address("q", 1)) and not static.can_write(Address("resid_post", 1))
    assert static.can_read(Address("resid_post", 1)) and not static.can_read(Address("resid_post", 0))
    with pytest.raises(BackendError, match="resid_post.1 is not written by this vllm-static engine"):
        plan(_handle(base, static), as_spec([Add("resid_post.1", torch.zeros(base.d_model))]), [], n_prompts=1,
             longest=4)
    with pytest.raises(BackendError, match="'sdpa' attention never forms"):
        plan(_handle(base, values["eager-sdpa"]), as_spec([]), [probs], n_prompts=1, longest=4)
    assert _handle(base, values["vllm-generate"]).points() == ()


# ------------------------------------------------------------------------------------------ load-time refusals

@pytest.mark.parametrize("keyword, value", [("static_points", "auto"), ("static_writes", ["resid_post.1"])])
def test_static_keywords_on_eager_name_the_backend_that_takes_them(tiny_path, keyword, value):
    with pytest.raises(BackendError) as caught:
        load_model(str(tiny_path("llama")), backend="eager", **{keyword: value})
    assert 'Fix: drop' in str(caught.value) and 'use backend="vllm-static"' in str(caught.value), caught.value
    assert 'backend="vllm"' not in str(caught.value)


@requires("vllm")
def test_static_keywords_on_vllm_generate_say_it_serves_no_point(tiny_path):
    with pytest.raises(BackendError) as caught:
        load_model(str(tiny_path("llama")), backend="vllm-generate", static_writes=["resid_post.1"])
    message = str(caught.value)
    assert "any point per request" not in message and "serves no point" in message, message
    assert 'backend="vllm-static"' in message and "Fix:" in message
