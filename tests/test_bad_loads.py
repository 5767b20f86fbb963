"""Bad load_model arguments on eager: refused before anything loads, with the nearest valid value where there is one,
and the loaded handles keep working."""

import pytest
import torch

from interp_engine import load_model
from interp_engine.errors import BackendError, InputTypeError, InterpEngineError, LoadError, SpecError
from tests.refusals import assert_still_works


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


def test_undiscoverable_architecture_refused_before_loading(eager, tmp_path):
    from transformers import T5Config

    # config.json only, no weights: reaching the error at all proves it came before any load. T5 has no table
    # and no causal LM to discover a residual stream in (tests/test_discovered.py has the discovered ones).
    T5Config().save_pretrained(str(tmp_path))
    assert_load_refused(eager, LoadError, ("a 't5' model", "no table", "builds no causal LM", "llama", "gpt2"),
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
    where = 'backend="vllm-static"' if keyword.startswith("static") else 'backend="vllm"'  # the one that takes it
    assert_load_refused(eager, BackendError, (f"{keyword}= is a vLLM setting", f"drop {keyword}= for eager", where),
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


@pytest.mark.parametrize("repo, fragments", [
    ("tiny-org/not-cached", ("'tiny-org/not-cached' is not in the local HF cache and HF_HUB_OFFLINE=1 forbids",
                             "unset HF_HUB_OFFLINE")),
    ("./no/such/folder", ("'./no/such/folder' is neither a local folder nor a valid HF repo id",
                          "pass a checkpoint folder that exists")),
])
def test_missing_folder_or_uncached_repo_offline(eager, offline_hub, repo, fragments):
    assert_load_refused(eager, LoadError, fragments, repo, backend="eager")


def test_folder_without_config_json(eager, tmp_path):
    assert_load_refused(eager, LoadError, ("has no config.json", "save_pretrained()"), str(tmp_path),
                        backend="eager")
