"""The sizer on MoE, MLA and hybrid linear attention: parameter counts equal HF's, a Kimi-K2.6-like config on 8x
H200 and a Qwen3.8-27B-like hybrid on 2x A40 priced against hand arithmetic from their config.json fixtures, bad
shapes refused, and a Kimi-K2 config through load_model: priced, and refused clearly where it cannot run."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.vllm_cpu_limits import TINY
from interp_engine.arch.vllm_cpu import CPU_DTYPES, NEEDS_TORCHVISION, cpu_refusals
from interp_engine.errors import BackendError, LoadError
from interp_engine.loading import load_model
from interp_engine.selection import Hardware, choose_backend, read_config
from interp_engine.sizing import count_params, estimate, estimate_from_config, to_config
from tests.skips import requires

CONFIGS = Path(__file__).parent / "configs"
KIMI, QWEN = CONFIGS / "kimi-k2.6-like", CONFIGS / "qwen3.8-27b-like"
RESULTS = Path(__file__).parents[1] / "benchmarks" / "results" / "vllm_cpu_limits.json"
GiB = 2**30


def _raw(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("model_type", ["gpt_oss", "deepseek_v3", "qwen3_next", "qwen3_5_text"])
def test_parameter_count_equals_hf(model_type):
    for overrides in ({}, {"tie_word_embeddings": True}):
        config = AutoConfig.for_model(model_type, **TINY[model_type], vocab_size=512, **overrides)
        with torch.device("meta"):
            real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        assert count_params(config).total == real


@pytest.mark.parametrize("folder", [KIMI, QWEN], ids=["kimi-k2.6", "qwen3.8-27b"])
def test_parameter_count_equals_hf_at_full_size(folder):
    text = to_config(_raw(folder))
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(text).parameters())
    assert count_params(_raw(folder)).total == real


def test_kimi_k2_6_on_8_h200_priced_by_hand():
    d, experts, top_k, layers, moe_layers, heads = 7168, 384, 8, 61, 60, 64
    q_a, kv_a = d * 1536, d * (512 + 64)
    attention = q_a + 1536 + 1536 * heads * (128 + 64) + kv_a + 512 + 512 * heads * (128 + 128) + heads * 128 * d
    expert = 3 * d * 2048
    routed = moe_layers * experts * expert
    total = (layers * (attention + 2 * d) + 3 * d * 18432 + moe_layers * (experts * d + expert) + routed
             + 2 * 163840 * d + d)
    active = total - routed + moe_layers * top_k * expert
    # Shipped: routed experts int4 in groups of 32 with a bf16 scale each; everything else bf16.
    weights = routed // 2 + 2 * (routed // 32) + 2 * (total - routed)
    replicated = 2 * (layers * (q_a + 1536 + kv_a + 512 + 2 * d) + moe_layers * experts * d + d)
    kv_token = 61 * (512 + 64) * 2  # one latent and one rope key per layer, no K/V split, bf16

    result = estimate(KIMI, backend="vllm", num_gpus=8, gpu="H200-141GB")
    assert (result.params, result.active_params, result.weight_bytes) == (total, active, weights)
    assert result.weight_bytes_per_gpu == replicated + math.ceil((weights - replicated) / 8)
    assert result.expert_bytes_per_gpu == math.ceil((routed // 2 + 2 * (routed // 32)) / 8)
    assert result.kv_bytes_per_token == kv_token == 70_272
    assert result.kv_bytes_per_gpu == kv_token * 262_144  # every rank holds the whole latent
    assert result.state_bytes_per_sequence == 0
    assert result.per_gpu_bytes == result.weight_bytes_per_gpu + result.kv_bytes_per_gpu + 2 * GiB
    assert result.fits and 1.0e12 < total < 1.1e12 and 30e9 < active < 35e9
    assert 'model = load_model("' + str(KIMI) + '", backend="vllm", num_gpus=8)' in result.report()
    assert "MLA latent" in result.report() and "vision tower is not" in result.report()
    # Unpacked (the same shape at bf16 throughout) it does not fit 8 x H200: the packing is what makes it fit.
    unpacked = {k: v for k, v in _raw(KIMI).items() if k != "quantization_config"}
    assert estimate_from_config(unpacked, backend="vllm", num_gpus=8, gpu="H200-141GB").weight_bytes == 2 * total
    assert not estimate_from_config(unpacked, backend="vllm", num_gpus=8, gpu="H200-141GB").fits


def test_qwen3_8_27b_hybrid_on_2_a40_priced_by_hand():
    d, layers, full = 5120, 64, 16
    linear = layers - full
    key_dim, value_dim, v_heads, conv = 16 * 128, 48 * 128, 48, 2 * 16 * 128 + 48 * 128
    attention = d * 2 * 24 * 256 + 2 * d * 4 * 256 + 24 * 256 * d + 2 * 256
    delta = d * (2 * key_dim + value_dim) + d * value_dim + 2 * d * v_heads + 4 * conv + value_dim * d + 2 * v_heads + 128
    total = full * attention + linear * delta + layers * (3 * d * 17408 + 2 * d) + 2 * 248320 * d + d
    kv_token = full * 2 * 4 * 256 * 2
    state = linear * (conv * 3 + v_heads * 128 * 128) * 2

    result = estimate(QWEN, backend="vllm", num_gpus=2, gpu="A40-48GB", max_model_len=32768, concurrency=4)
    assert (result.params, result.active_params, result.weight_bytes) == (total, total, 2 * total)
    assert (result.kv_bytes_per_token, result.state_bytes_per_sequence) == (kv_token, state)
    assert result.kv_bytes_per_gpu == kv_token // 2 * 32768 * 4  # 4 KV heads, 2 a rank
    assert result.state_bytes_per_gpu == state // 2 * 4  # fixed per sequence, split by heads
    assert result.per_gpu_bytes == (result.weight_bytes_per_gpu + result.kv_bytes_per_gpu + result.state_bytes_per_gpu
                                    + 2 * GiB)
    assert result.fits and 26e9 < total < 28e9
    assert 'backend="vllm", num_gpus=2, max_model_len=32768)' in result.snippet


@pytest.mark.parametrize(("folder", "change", "words"), [
    (KIMI, {"num_experts_per_tok": 400}, "num_experts_per_tok=400 > 384 experts"),
    (KIMI, {"kv_lora_rank": 0}, "kv_lora_rank=0"),
    (KIMI, {"qk_rope_head_dim": None}, "qk_rope_head_dim"),  # transformers names it first
    (QWEN, {"layer_types": ["linear_attention"] * 3}, "`layer_types` (3)"),  # transformers' own check
    (KIMI, {"n_routed_experts": 0}, "n_routed_experts=0"),
    (QWEN, {"linear_num_value_heads": 0}, "linear_num_value_heads=0"),
], ids=["top-k", "latent", "rope", "layer-count", "experts", "value-heads"])
def test_bad_shapes_are_refused_with_the_fix(folder, change, words):
    raw = _raw(folder)
    raw["text_config"] = {**raw["text_config"], **change}
    with pytest.raises(LoadError) as caught:
        estimate_from_config(raw)
    assert words in str(caught.value) and "Fix:" in str(caught.value)


def test_kimi_k2_style_config_is_priced_as_deepseek_v3():
    raw = {**_raw(KIMI)["text_config"], "model_type": "kimi_k2"}
    assert count_params(raw).total == count_params(_raw(KIMI)).total


def test_a_kimi_k2_config_reads_and_is_refused_clearly_before_loading():
    """config.json alone (no weights, no tokenizer): read as its text model (deepseek_v3, the wrapper's dtype),
    priced, refused before anything loads."""
    source, config = read_config(str(KIMI))
    assert config.model_type == "deepseek_v3" and config.kv_lora_rank == 512 and config.dtype == torch.bfloat16
    for backend in ("vllm", "eager"):  # 553 GiB of weights on this machine (or a single GPU's)
        with pytest.raises(LoadError, match="cannot fit") as caught:
            load_model(str(KIMI), backend=backend)
        assert "553.4 GiB" in str(caught.value) and "estimate(" in str(caught.value)


def test_qwen3_5_is_refused_on_vllm_cpu_where_torchvision_does_not_import(without_torchvision):
    source, config = read_config(str(QWEN))
    with pytest.raises(BackendError) as caught:
        choose_backend(config, source, force_backend="vllm", vllm_available=True, hardware=Hardware(cuda=False))
    assert cpu_refusals()["qwen3_5_text"] in str(caught.value) and "Fix:" in str(caught.value)
    assert choose_backend(config, source, force_backend="vllm", vllm_available=True,
                          hardware=Hardware(cuda=True)).use_vllm  # on CUDA the table does not apply
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="vllm-cpu"):
            load_model(str(QWEN), backend="vllm")


def test_only_a_model_whose_vllm_module_imports_torchvision_asks_whether_it_imports(monkeypatch):
    """Importing torchvision takes about a second: a CPU load of any other model does not pay it."""
    from interp_engine.arch import vllm_cpu

    asked = []
    monkeypatch.setattr(vllm_cpu, "torchvision_failure", lambda: asked.append(1) or "ImportError: blocked")
    for family in ("gpt_neox", "qwen3_next"):
        assert vllm_cpu.cpu_refusal(AutoConfig.for_model(family, **TINY[family]), torch.bfloat16) is None
    assert not asked
    qwen = AutoConfig.for_model("qwen3_5_text", **TINY["qwen3_5_text"], vocab_size=512)
    assert "ImportError: blocked" in vllm_cpu.cpu_refusal(qwen, torch.bfloat16) and asked


@pytest.mark.parametrize("family", ["qwen3_next", *(pytest.param(f, marks=requires("torchvision"))
                                                    for f in ("qwen3_5_text", "qwen3_5_moe_text"))])
def test_a_family_vllm_cpu_runs_at_one_dtype_is_refused_at_another(family):
    config = AutoConfig.for_model(family, **TINY[family], vocab_size=512)
    ask = dict(force_backend="vllm", vllm_available=True, hardware=Hardware(cuda=False, cpu_bf16=True))
    with pytest.raises(BackendError, match='requires BF16.*dtype="bfloat16"'):
        choose_backend(config, "m", requested_dtype="float32", **ask)
    assert choose_backend(config, "m", requested_dtype="bfloat16", **ask).dtype == torch.bfloat16


def test_refusal_tables_agree_with_the_measurement():
    """Every family measured ran on vllm-cpu, those whose vLLM module imports torchvision with the one
    scripts/setup.sh installs (refused only where it does not import); a dtype-only family ran at that dtype."""
    families = json.loads(RESULTS.read_text())["families"]
    assert set(NEEDS_TORCHVISION) <= set(families) and all(r["vllm_runs"] for r in families.values())
    assert all(families[t]["vllm_runs"] and families[t]["dtype"] == str(d).removeprefix("torch.")
               for t, (d, _) in CPU_DTYPES.items())


def test_qwen3_5_moe_parameter_count_equals_hf():
    from interp_engine.tiny import _BASE

    config = AutoConfig.for_model("qwen3_5_moe_text", **_BASE["qwen3_5_moe_text"], vocab_size=512)
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count_params(config).total == real
