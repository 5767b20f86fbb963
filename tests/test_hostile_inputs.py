"""Issue 19, items 8 and 7: hostile spec JSON, inputs and model folders get the library's error with a Fix: line,
before any forward pass (eager and vLLM), before any code from the folder runs, and before any allocation.

Decisions the cases pin down: integers read as positions, heads, layers, shape sizes or top_k lie within +-(2**31-1)
(far above any model, far below int64 overflow), so a slice stop of 2**63 is refused rather than read as "to the
end" (None says that); seeds lie in 0..2**63-1; a spec tensor is float16, bfloat16, float32 or float64 (float8 has
no CPU kernels for the NaN scan); token ids come only from integer tensors or lists of ints, never bools.
"""

import base64
import builtins
import json
import subprocess
import sys

import pytest
import torch

from interp_engine import Spec, capture, generate, load_model, steer
from interp_engine import spec as S
from interp_engine.errors import InputTypeError, LoadError, PointError, SpecError
from interp_engine.load_guards import HEADROOM, check_fits
from interp_engine.selection import BackendSelection
from interp_engine.tiny import build_tiny_model
from tests.conftest import spec_dict
from tests.refusals import assert_refused, assert_refused_on_vllm
from tests.skips import requires

PROMPT = "Hello, world! Tell me a story"
BIG = 10**400  # what a JSON file can hold: json.loads reads up to 4300 digits


def _tensor(dtype: str, shape: list, data: bytes = b"") -> dict:
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(data).decode()}


def _steer_json(**op):
    return lambda m: steer(m, PROMPT, Spec.from_dict(json.loads(json.dumps(spec_dict(**op)))), progress=False)


def _scale(**extra):
    return _steer_json(op="Scale", point="resid_post.0", factor=2.0, **extra)


def _nested(depth: int) -> list:
    value: list = [1]
    for _ in range(depth):
        value = [value]
    return value


# (call, error, fragments): every case of item 8, each refused before any forward pass with a Fix: line.
HOSTILE = [
    pytest.param(_steer_json(op="Add", point="resid_post.0", vector=_tensor("float8_e4m3fn", [128], bytes(128))),
                 SpecError, ("'float8_e4m3fn' is not one a spec holds", "store them as float32"), id="float8-json"),
    pytest.param(lambda m: steer(m, PROMPT, S.Add("resid_post.0", torch.zeros(128).to(torch.float8_e5m2))),
                 SpecError, ("float8_e5m2 (a float without the CPU kernels", "vector.float()"), id="float8-tensor"),
    pytest.param(_steer_json(op="Add", point="resid_post.0", vector=_tensor("float32", [2**62, 2**62])),
                 SpecError, ("is not a list of at most 8 sizes in 0..2147483647",), id="overflowing-shape"),
    pytest.param(_steer_json(op="Add", point="resid_post.0", vector=_tensor("float32", [0, 2**70])),
                 SpecError, ("is not a list of at most 8 sizes",), id="overflowing-empty-shape"),
    pytest.param(_steer_json(op="Add", point="resid_post.0", vector=_tensor("float32", [1] * 9, bytes(4))),
                 SpecError, ("at most 8 sizes",), id="too-many-axes"),
    pytest.param(_steer_json(op="Scale", point="resid_post.0", factor=BIG), SpecError,
                 ("Scale.factor is an integer of 1329 bits, not a finite float", "use a finite factor"),
                 id="400-digit-factor"),
    pytest.param(_scale(positions=[BIG]), SpecError, ("position an integer of 1329 bits", "+-2147483647"),
                 id="400-digit-position"),
    pytest.param(_steer_json(op="Ablate", point="q.0", heads=[BIG]), SpecError,
                 ("is not a list of head indices",), id="400-digit-head"),
    pytest.param(_steer_json(op="Scale", point="resid_post." + "9" * 400, factor=2.0), PointError,
                 ("has 400 digits; no model has that many layers",), id="400-digit-layer"),
    pytest.param(lambda m: steer(m, PROMPT, S.Scale("resid_post.0", 2.0, positions=_nested(3000))), SpecError,
                 ("nest one list per prompt inside another",), id="deeply-nested-positions"),
    pytest.param(_scale(positions=json.loads('{"per_prompt": [' * 200 + "1" + "]}" * 200)), SpecError,
                 ("is not one entry per prompt",), id="deeply-nested-per-prompt-json"),
    pytest.param(lambda m: steer(m, PROMPT, Spec.from_dict({**spec_dict(op="Scale", point="resid_post.0",
                                                                         factor=2.0), "version": 2})),
                 SpecError, ("unknown keys 'version'", "holds 'interp_engine_spec' and 'ops' only"),
                 id="unknown-spec-key"),
    pytest.param(_steer_json(op="Add", point="resid_post.0",
                             vector={**_tensor("float32", [128], bytes(512)), "endian": "big"}),
                 SpecError, ("unknown keys 'endian'", "holds dtype, shape and data only"), id="unknown-tensor-key"),
    pytest.param(_scale(positions={"slice": [0, 2, 1], "step": 2}), SpecError,
                 ('holds one key, "slice" or "per_prompt"',), id="unknown-positions-key"),
    pytest.param(_steer_json(op="Scale", point="resid_post.0", factor=2.0, sign=-1), SpecError,
                 ("unknown fields ['sign']", "Scale takes point, factor, heads, positions"), id="unknown-op-field"),
    pytest.param(lambda m: capture(m, PROMPT, ["blocks.99999999999999999999999.hook_resid_post"]), PointError,
                 ("has 23 digits; no model has that many layers",), id="huge-tl-layer"),
    pytest.param(lambda m: capture(m, PROMPT, ["blocks.2147483648.hook_resid_post"]), PointError,
                 ("integer of 32 bits; no model has that many layers",), id="tl-layer-past-int32"),
    pytest.param(lambda m: capture(m, torch.tensor([[1.7, 2.2]]), ["resid_post.0"]), InputTypeError,
                 ("dtype torch.float32; token ids are integers", "ids.long()"), id="float-token-tensor"),
    pytest.param(lambda m: capture(m, torch.tensor([[True, False]]), ["resid_post.0"]), InputTypeError,
                 ("dtype torch.bool; token ids are integers",), id="bool-token-tensor"),
    pytest.param(lambda m: capture(m, [torch.tensor([1.7, 2.2])], ["resid_post.0"]), InputTypeError,
                 ("prompts[0] tensor has dtype torch.float32",), id="float-token-tensor-in-list"),
    pytest.param(lambda m: capture(m, [[True, 5]], ["resid_post.0"]), InputTypeError,
                 ("prompt 0 holds True (bool); token ids are ints",), id="bool-token-ids"),
    # beartype checks one random row: it or to_prompts (which reads every row) refuses, either with a Fix: line.
    pytest.param(lambda m: capture(m, [[1, 2]] * 40 + [[3, [4]]], ["resid_post.0"]), InputTypeError,
                 ("token",), id="nested-token-ids"),
    pytest.param(lambda m: capture(m, torch.tensor([[1 + 0j]]), ["resid_post.0"]), InputTypeError,
                 ("complex64; token ids are integers",), id="complex-token-tensor"),
    pytest.param(lambda m: steer(m, PROMPT, S.Add("resid_post.0", torch.randn(128, dtype=torch.complex64))),
                 SpecError, ("dtype torch.complex64; edits need a floating-point tensor",), id="complex-vector"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=float("nan")), SpecError,
                 ("temperature=nan", "a finite temperature >= 0"), id="nan-temperature"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=float("inf")), SpecError,
                 ("temperature=inf",), id="inf-temperature"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=-0.5), SpecError,
                 ("temperature=-0.5",), id="negative-temperature"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=1.0, seed=2**64), SpecError,
                 ("seed=an integer of 65 bits is outside 0..2**63-1",), id="huge-seed"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=1.0, seed=-1), SpecError,
                 ("seed=-1 is outside 0..2**63-1",), id="negative-seed"),
    pytest.param(lambda m: generate(m, PROMPT, max_new_tokens=2, temperature=1.0, top_k=2**63), SpecError,
                 ("top_k=9223372036854775808", "top_k in 1..2147483647"), id="huge-top-k"),
    pytest.param(_scale(positions={"slice": [0, 2**63, 1]}), SpecError,
                 ("position 9223372036854775808 is past any prompt", "None in a slice"), id="slice-stop-2**63"),
    pytest.param(_scale(positions={"slice": [-2**63 - 5, None, 2**64]}), SpecError,
                 ("position -9223372036854775813",), id="slice-start-below-int64"),
    pytest.param(lambda m: steer(m, PROMPT, S.Add("resid_post.0", torch.randn(1, 0, 128))), SpecError,
                 ("vector has shape (1, 0, 128), with an empty axis",), id="vector-1-0-128"),
]


@pytest.mark.parametrize("call, error, fragments", HOSTILE)
def test_hostile_input_refused_before_forward_on_eager(eager, call, error, fragments):
    assert_refused(eager("llama"), call, error, *fragments)


@requires("vllm")
@pytest.mark.parametrize("call, error, fragments", HOSTILE)
def test_hostile_input_refused_before_any_request_on_vllm(served_llama, call, error, fragments):
    assert_refused_on_vllm(served_llama, call, error, *fragments)


def test_the_largest_legal_slice_stop_still_means_to_the_end(eager):
    model = eager("llama")
    edited = steer(model, PROMPT, S.Scale("resid_post.0", 0.0, positions=slice(1, 2**31 - 1)), progress=False)
    same = steer(model, PROMPT, S.Scale("resid_post.0", 0.0, positions=slice(1, None)), progress=False)
    torch.testing.assert_close(edited, same)


# ----------------------------------------------------------------------- base64 length before decoding

_PEAK = """
import base64, json, sys
from interp_engine.spec import Spec
n, claimed = int(sys.argv[1]), int(sys.argv[2])
data = base64.b64encode(bytes(n)).decode()
raw = {"interp_engine_spec": 1, "ops": [{"op": "Add", "point": "resid_post.0",
       "vector": {"dtype": "float32", "shape": [claimed // 4], "data": data}}]}
def mem(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
before = mem("VmRSS")
try:
    Spec.from_dict(raw)
    outcome = "read"
except Exception as e:
    outcome = type(e).__name__
print(json.dumps({"outcome": outcome, "extra": mem("VmHWM") - before}))
"""


def _peak(payload: int, claimed: int) -> dict:
    done = subprocess.run([sys.executable, "-c", _PEAK, str(payload), str(claimed)], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_base64_payload_costs_at_most_its_decoded_size_once():
    """150 MiB of float32: the tensor itself plus a 4 MiB piece at a time (it used to cost +350 MiB)."""
    size = 150 << 20
    read = _peak(size, size)
    assert read["outcome"] == "read"
    # The tensor itself plus pieces and allocator slack (165-179 MiB measured over runs); decoding the whole
    # payload at once, as before, cost +455 MiB.
    assert read["extra"] < size + (64 << 20), f"peak +{read['extra'] >> 20} MiB for a {size >> 20} MiB payload"
    print(f"peak for a {size >> 20} MiB payload: +{read['extra'] / 2**20:.1f} MiB")


def test_a_base64_payload_of_the_wrong_length_is_refused_before_decoding():
    wrong = _peak(150 << 20, 512)
    assert wrong["outcome"] == "SpecError"
    assert wrong["extra"] < 4 << 20, f"peak +{wrong['extra'] >> 20} MiB for a refused payload"


def test_the_length_message_names_both_sizes():
    raw = spec_dict(op="Add", point="resid_post.0", vector=_tensor("float32", [128], bytes(100)))
    with pytest.raises(SpecError, match=r"136 base64 characters, but shape \[128\] of float32 is 512 bytes"):
        Spec.from_dict(raw)


# ------------------------------------------------------------------------------- item 7: model folders

@pytest.fixture(scope="module")
def trap(tmp_path_factory):
    """A tiny Llama whose tokenizer_config.json maps AutoTokenizer to evil.py (and names no tokenizer class
    transformers ships), so transformers would ask on the terminal; importing evil.py creates a marker."""
    folder = build_tiny_model("llama", tmp_path_factory.mktemp("tokenizer-trap") / "llama")
    marker = folder.parent / "EXECUTED"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import PreTrainedTokenizerFast\n\n\n"
                                    "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("tokenizer_class", None)
    config["auto_map"] = {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, marker


@pytest.fixture
def no_prompt(monkeypatch):
    """Records every terminal prompt (transformers asks through input())."""
    asked: list[str] = []

    def record(prompt=""):
        asked.append(prompt)
        return "y"  # what a user who answers yes would type: the folder's code would then run

    monkeypatch.setattr(builtins, "input", record)
    return asked


@pytest.mark.parametrize("backend", ["eager", pytest.param("vllm", marks=requires("vllm"))])
def test_a_tokenizer_auto_map_is_refused_without_a_prompt(trap, no_prompt, backend):
    folder, marker = trap
    with pytest.raises(LoadError) as info:
        load_model(str(folder), backend=backend)
    message = str(info.value)
    assert "names its own tokenizer code" in message
    assert "Fix: pass trust_remote_code=True" in message and "with your permissions" in message
    assert not no_prompt, f"transformers prompted: {no_prompt}"
    assert not marker.exists(), "the folder's code ran"


def test_the_folder_code_runs_only_when_asked(trap, no_prompt):
    folder, marker = trap
    model = load_model(str(folder), backend="eager", device="cpu", trust_remote_code=True)
    assert type(model.runtime.tokenizer).__name__ == "EvilTokenizer"
    assert marker.exists() and not no_prompt  # evil.py was imported: asked for, and without a prompt


def test_a_config_auto_map_for_an_unknown_model_type_never_prompts(tmp_path, no_prompt):
    folder = build_tiny_model("llama", tmp_path / "llama")
    marker = tmp_path / "EXECUTED"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="Fix:"):
        load_model(str(folder), backend="eager")
    assert not no_prompt and not marker.exists()


ABSURD = {"1e6-layers": {"num_hidden_layers": 10**6},
          "hidden-2**20": {"hidden_size": 2**20, "intermediate_size": 2**20, "num_attention_heads": 2**14,
                           "num_key_value_heads": 2**14},
          "vocab-2**40": {"vocab_size": 2**40}}


def _variant(tiny_path, tmp_path, change: dict):
    folder = tmp_path / "model"
    folder.mkdir()
    for file in tiny_path("llama").iterdir():
        if file.is_file():
            (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    return folder


@pytest.mark.parametrize("backend", ["eager", pytest.param("vllm", marks=requires("vllm"))])
@pytest.mark.parametrize("change", list(ABSURD.values()), ids=list(ABSURD))
def test_a_config_that_cannot_fit_is_refused_before_allocating(tiny_path, tmp_path, change, backend):
    import psutil

    folder = _variant(tiny_path, tmp_path, change)
    rss, children = psutil.Process().memory_info().rss, len(psutil.Process().children(recursive=True))
    with pytest.raises(LoadError) as info:
        load_model(str(folder), backend=backend)
    message = str(info.value)
    assert "for its weights alone" in message and "it cannot fit" in message and "GiB" in message
    assert "Fix: load it quantized (quantization=" in message and "num_gpus=" in message
    assert psutil.Process().memory_info().rss - rss < 256 << 20
    assert len(psutil.Process().children(recursive=True)) == children


def _selection(dtype=torch.bfloat16, device="cuda") -> BackendSelection:
    return BackendSelection(backend="eager", use_vllm=False, device=device, dtype=dtype, reason="")


@pytest.mark.parametrize("name, sizes, there_gib", [
    ("Llama-3-8B on a 24 GiB card and 8 GiB free RAM", dict(hidden_size=4096, intermediate_size=14336,
                                                            num_hidden_layers=32, num_attention_heads=32,
                                                            num_key_value_heads=8, vocab_size=128256), 32),
    ("Llama-3-70B on 80 GiB and 64 GiB RAM", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                                  num_attention_heads=64, num_key_value_heads=8,
                                                  vocab_size=128256), 144),
    ("Llama-3-8B on a laptop with 12 GiB free", dict(hidden_size=4096, intermediate_size=14336,
                                                    num_hidden_layers=32, num_attention_heads=32,
                                                    num_key_value_heads=8, vocab_size=128256), 12),
])
def test_realistic_models_are_never_refused(name, sizes, there_gib):
    """The rule: refuse only when the weights alone exceed HEADROOM (2) x free device memory plus CPU RAM."""
    from transformers import LlamaConfig

    check_fits(name, LlamaConfig(**sizes), _selection(), quantization=None, num_gpus=1,
               there=(there_gib << 30, f"{there_gib} GiB"))


def test_the_headroom_rule_is_the_boundary():
    from transformers import LlamaConfig

    from interp_engine.sizing import count_params

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256)
    need = count_params(config).bytes(2, None)
    check_fits("8B", config, _selection(), quantization=None, num_gpus=1, there=(-(-need // HEADROOM), "edge"))
    with pytest.raises(LoadError, match="refused above 2x the memory there"):
        check_fits("8B", config, _selection(), quantization=None, num_gpus=1, there=(need // HEADROOM - 1, "less"))
    # quantization is priced: the same model in 4 bits fits where bf16 does not
    check_fits("8B", config, _selection(), quantization="bnb-4bit", num_gpus=1, there=(need // HEADROOM - 1, "less"))


def test_every_tiny_family_loads(tiny_path, family):
    load_model(str(tiny_path(family)), backend="eager", device="cpu")


@pytest.mark.parametrize("change", [{"num_attention_heads": 0}, {"hidden_size": -64}, {"num_hidden_layers": 0},
                                    {"vocab_size": -5}, {"num_key_value_heads": 0}, {"intermediate_size": -1},
                                    {"head_dim": 0}, {"max_position_embeddings": 0}],
                         ids=lambda c: "{}={}".format(*next(iter(c.items()))))
def test_zero_or_negative_sizes_give_a_clear_error(tiny_path, tmp_path, change):
    from interp_engine.sizing import estimate

    key, value = next(iter(change.items()))
    folder = _variant(tiny_path, tmp_path, change)
    for call in (lambda: estimate(str(folder)), lambda: load_model(str(folder), backend="eager")):
        with pytest.raises(LoadError) as info:
            call()
        assert f"config.json has {key}={value}; a model size must be a whole number of at least 1" in str(info.value)
        assert f"Fix: correct {key} in config.json" in str(info.value)
