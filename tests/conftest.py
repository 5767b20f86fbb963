"""Tiny real models built once per session from real configs; the purity check that runs around every test."""

import asyncio
import signal
import warnings
from contextlib import contextmanager

import huggingface_hub.constants
import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import AutoModelForCausalLM

from interp_engine import load_model
from interp_engine.tiny import FAMILIES, build_tiny_model

PROMPTS = ["Hello, world! Tell me a story", "Paris is the capital of", "The quick brown fox jumps over the lazy dog."]
_MODELS: dict = {}
_BASELINES: dict = {}
_MODULE_IDS: dict = {}  # key -> ids of the model's modules, to tell which models a test ran
_RAN: set[int] = set()  # ids of the modules called since the last purity check


def _note_call(module, args):
    _RAN.add(id(module))


# Global, and only ever adds an id: it leaves every module's own hook dicts empty (which the check asserts).
torch.nn.modules.module.register_module_forward_pre_hook(_note_call)

# Hypothesis' per-example deadline and too_slow check time the machine, not the code (a loaded 2-core runner
# failed a spec round trip on them): speed is measured in benchmarks/, never asserted in tests.
settings.register_profile("interp_engine", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("interp_engine")


@contextmanager
def no_child_survives():
    """Every child process started inside the block (vLLM's engine and workers) must be gone at its end."""
    import psutil

    from interp_engine.backends.vllm.runtime import resource_tracker_pid

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True)
            if p.pid not in before and p.pid != resource_tracker_pid()]
    assert not left, f"child processes survived shutdown(): {left}"


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """tiny_path(family) -> folder of a tiny fp32 model of that family (built once per session)."""
    root = tmp_path_factory.mktemp("tiny")
    built: dict[str, object] = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_model(family, root / family)
        return built[family]

    return get


@pytest.fixture
def without_torchvision(monkeypatch):
    """As where torchvision does not import: arch/vllm_cpu.torchvision_failure says what it reads of that failure
    (tests/test_wrappers.py checks that reading on a real failed import)."""
    from interp_engine.arch import vllm_cpu

    monkeypatch.setattr(vllm_cpu, "torchvision_failure", lambda: "ModuleNotFoundError: No module named 'torchvision'")


@pytest.fixture(scope="session")
def eager(tiny_path):
    """eager(family, attn="eager", grad=False) -> a loaded handle, shared by the session."""

    def get(family: str, attn: str = "eager", grad: bool = False):
        key = (family, attn, grad)
        if key not in _MODELS:
            handle = load_model(str(tiny_path(family)), backend="eager", attn_implementation=attn,
                                requires_grad=grad, device="cpu")
            handle.runtime.load()
            _MODELS[key] = handle
            _BASELINES[key] = (_param_digest(handle), _baseline_logits(handle))
            _MODULE_IDS[key] = frozenset(id(m) for m in handle.runtime.model.modules())
        return _MODELS[key]

    return get


SHARED = "served_llama"


def pytest_collection_modifyitems(session, config, items):
    """The modules that use `served_llama` run one after another, where the first of them would, so that they
    share its engine (an engine start costs 20-35 s on 2 cores); every other module keeps its place."""
    modules: dict = {}
    for item in items:
        modules.setdefault(item.module, []).append(item)
    sharing = [m for m, its in modules.items() if any(SHARED in it.fixturenames for it in its)]
    if len(sharing) < 2:
        return
    order = [m for m in modules if m not in sharing]
    first = list(modules).index(sharing[0])
    order[first:first] = sharing
    items[:] = [item for m in order for item in modules[m]]


@pytest.fixture(scope="session")
def _llama_handle(tiny_path):
    """The handle `served_llama` shares, and the child processes from before its engine started."""
    from types import SimpleNamespace

    shared = SimpleNamespace(model=load_model(str(tiny_path("llama")), backend="vllm", max_model_len=64), before=set())
    yield shared
    asyncio.run(shared.model.shutdown())  # where the last module using it did not run to its end


@pytest.fixture(scope="module")
def served_llama(request, _llama_handle):
    """A live vLLM handle on the tiny Llama with a 64-token context. The modules using it run in a row
    (`pytest_collection_modifyitems`) and share one engine; shut down at the end of the last of them (vLLM holds
    one engine per process), after which no child process may remain, and started afresh should a module leave
    it broken."""
    import psutil

    model = _llama_handle.model
    if model.is_loaded and not model.runtime.is_alive():
        asyncio.run(model.shutdown())
    if not model.is_loaded:
        _llama_handle.before = {p.pid for p in psutil.Process().children(recursive=True)}
    asyncio.run(model.warmup())
    yield model
    items = request.session.items
    after = items[max(i for i, item in enumerate(items) if item.module is request.module) + 1:]
    if not any(SHARED in item.fixturenames for item in after if item.module is after[0].module):
        asyncio.run(model.shutdown())
        from interp_engine.backends.vllm.runtime import resource_tracker_pid

        left = [p for p in psutil.Process().children(recursive=True)
                if p.pid not in _llama_handle.before and p.pid != resource_tracker_pid()]
        assert not left, f"child processes survived shutdown(): {left}"


@pytest.fixture(scope="session")
def server(tiny_path, tmp_path_factory):
    """(process, base url, model path): the one `interp-engine serve` of the session on the tiny Llama
    (`tests/servers.py`), shared by tests/test_serve.py, test_serve_bad_requests.py and test_serve_lifetime.py,
    whose SIGTERM test stops it (pytest runs those modules in that order); stopped here if that test did not run."""
    from interp_engine.backends.vllm import sae_refs
    from tests.servers import SAE_BOUND, served

    yield from served(str(tiny_path("llama")), tmp_path_factory, env={sae_refs.BOUND_ENV: str(SAE_BOUND)})


@pytest.fixture(scope="session")
def api(server):
    """The official openai client of the session's server."""
    import openai

    from tests.servers import KEY

    return openai.OpenAI(base_url=server[1], api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def hf_reference(tiny_path):
    """hf_reference(family) -> a plain HF model (eager attention) that interp_engine never touched."""
    refs: dict = {}

    def get(family: str):
        if family not in refs:
            refs[family] = AutoModelForCausalLM.from_pretrained(str(tiny_path(family)), attn_implementation="eager",
                                                                dtype=torch.float32).eval()
        return refs[family]

    return get


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test (the sizer reads config.json and nothing else)."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("the test tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty HF cache of our own, offline, so the real cache is never consulted; returns its folder."""
    hub = tmp_path / "hf_home" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the environment once, at import: patch what it read as well.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return hub


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


class Payload:
    """Unpickling this creates `path`: proof that something was executed (for the tests that a spec is data)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        from pathlib import Path

        return Path.touch, (self.path,)


def spec_dict(**op) -> dict:
    """A saved spec (`Spec.to_dict` form) holding the single op `op`, written by hand."""
    return {"interp_engine_spec": 1, "ops": [op]}


def check_each_request_gets_its_own_vector(model, reference, close) -> list[str]:
    """16 requests in one engine batch, each steered with its own vector: requests 0, 7 and 15 each equal their
    solo run on `reference` (eager), compared with `close(ours, theirs, what)`. Returns the prompts."""
    from interp_engine import spec as S
    from interp_engine import steer

    prompts = [PROMPTS[i % 3] + " " + str(i) for i in range(16)]
    width = max(len(model.tokenize(p)) for p in prompts)
    vectors = torch.randn(16, 1, model.d_model, generator=torch.Generator().manual_seed(0)).expand(16, width, -1)
    batch = steer(model, prompts, S.Add("resid_post.0", vectors.contiguous()))
    for i in (0, 7, 15):
        solo = steer(reference, prompts[i], S.Add("resid_post.0", vectors[i, 0]))
        n = len(model.tokenize(prompts[i]))
        close(batch[i, :n], solo[0], f"request {i}")
    return prompts


def random_sae(d: int, layer: int, seed: int, **kw):
    """A random SAE of resid_post.`layer` of a d-wide model, 4x wide (`kw`: activation, k, normalize, ...)."""
    from interp_engine import SAE

    g = torch.Generator().manual_seed(seed)
    return SAE(torch.randn(d, 4 * d, generator=g) / d ** 0.5, 0.1 * torch.randn(4 * d, generator=g),
               torch.randn(4 * d, d, generator=g) / d ** 0.5, 0.1 * torch.randn(d, generator=g),
               f"resid_post.{layer}", **kw)


def check_no_steered_kv_reaches_a_plain_call(model, reference) -> None:
    """vLLM's prefix cache keys KV blocks by their tokens. A steered prefill and a steered generation run first
    on a fresh prompt of two blocks and more; a plain generation on it afterwards must equal `reference`'s
    (eager), i.e. it must not read the steered KV."""
    from interp_engine import generate, steer
    from interp_engine import spec as S

    block = model.runtime.load().llm_engine.vllm_config.cache_config.block_size
    ids = torch.randint(3, 500, (2 * block + 5,), generator=torch.Generator().manual_seed(2027)).tolist()
    spec = S.Add("resid_post.0", torch.full((model.d_model,), 50.0))
    steer(model, [ids], spec, progress=False)
    steered = generate(model, [ids], spec, max_new_tokens=6, stop_at_eos=False, progress=False).tokens
    plain = generate(model, [ids], max_new_tokens=6, stop_at_eos=False, progress=False).tokens
    expected = generate(reference, [ids], max_new_tokens=6, stop_at_eos=False, progress=False).tokens
    assert steered != expected, "the edit must change the tokens, or this checks nothing"
    assert plain == expected


def _param_digest(handle) -> list[torch.Tensor]:
    return [p.detach().clone() for p in handle.runtime.model.parameters()]


def _baseline_logits(handle) -> torch.Tensor:
    ids = torch.tensor([handle.tokenize(PROMPTS[0])])
    with torch.inference_mode():
        return handle.runtime.model(input_ids=ids).logits.clone()


def assert_pure(handle, params: list[torch.Tensor] | None, logits: torch.Tensor | None) -> None:
    """No hook on any module; parameters and baseline logits bit-identical (each unless None)."""
    model = handle.runtime.model
    for name, module in model.named_modules():
        hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks,
                 getattr(module, "_forward_hooks_with_kwargs", {}), getattr(module, "_forward_pre_hooks_with_kwargs", {}))
        assert not any(hooks), f"a hook survived on {name or 'the model'} of {handle.name}"
    for before, after in zip(params, model.parameters(), strict=True) if params is not None else ():
        assert torch.equal(before, after), f"a parameter of {handle.name} changed"
    if logits is not None:
        assert torch.equal(_baseline_logits(handle), logits), f"baseline logits of {handle.name} changed"


@pytest.fixture(autouse=True)
def purity():
    """After every test: no hook on any module of any loaded model; parameters and baseline logits
    bit-identical on every model that ran since the last check (any of its modules was called). Comparing every
    loaded model's parameters and running its baseline forward after every test was almost all of this check's
    cost (about 13 models loaded for most of the run; 0.6 s a test on an idle machine, over 3 s on a loaded
    one); a change to a model no test ran (a parameter edited in place, an attribute) is caught at its module's
    end by `_purity_per_module`, which names the module."""
    yield
    ran = set(_RAN)
    try:
        for key, handle in _MODELS.items():
            if handle.runtime.model is not None:
                both = _BASELINES[key] if ran & _MODULE_IDS[key] else (None, None)
                assert_pure(handle, *both)
    finally:
        _RAN.clear()  # the check's own forwards are not the next test's


@pytest.fixture(scope="module", autouse=True)
def _purity_per_module(request):
    """At the end of each test module, every loaded model checked in full, ran or not (see `purity`)."""
    yield
    try:
        for key, handle in _MODELS.items():
            if handle.runtime.model is not None:
                try:
                    assert_pure(handle, *_BASELINES[key])
                except AssertionError as e:
                    raise AssertionError(f"{str(e).splitlines()[0]}, during {request.node.nodeid}, in a test that ran "
                                         "none of its modules") from None
    finally:
        _RAN.clear()


@pytest.fixture(autouse=True)
def _ctrl_c_is_pythons(request):
    """Each test starts with Python's own Ctrl-C handler, as a user's program has it. One full run (on a machine
    loaded by a stray process) saw every Ctrl-C test after test_engine_life's first three fail with "DID NOT
    RAISE KeyboardInterrupt": some handler had been left behind. It did not happen again, alone or under load;
    if it does, the test that left it is named here (a warning in the summary) instead of failing every later
    Ctrl-C test."""
    yield
    left = signal.getsignal(signal.SIGINT)
    if left is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        warnings.warn(f"{request.node.nodeid} left SIGINT handled by {left!r}; Python's own handler "
                      "restored", UserWarning, stacklevel=1)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield
