"""The GPU sizer: parameter counts equal HF's for every family, and three real configs priced against hand sums
(its knobs and snippet: test_sizing_knobs.py; its CLI, bad inputs and GPU table: test_sizing_cli.py)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from interp_engine import quantization
from interp_engine.arch import supported_model_types
from interp_engine.sizing import LAYOUTS, SCHEMES, count_params, estimate, to_config
from interp_engine.tiny import _BASE, FAMILIES
from tests.sizing_configs import GiB, LLAMA_8B, LLAMA_70B, QWEN3_32B, within, write_config

pytestmark = pytest.mark.usefixtures("no_network")  # conftest: the sizer reads config.json and nothing else


# ------------------------------------------------------------------------------------ parameter counts

_VARIATIONS = {
    "llama": [{"tie_word_embeddings": True}, {"attention_bias": True}, {"mlp_bias": True, "head_dim": 64}],
    "mistral": [{"tie_word_embeddings": True}, {"head_dim": 64}, {"num_key_value_heads": 4}],
    "qwen2": [{"tie_word_embeddings": True}, {"num_key_value_heads": 4}, {"intermediate_size": 384}],
    "qwen3": [{"tie_word_embeddings": True}, {"attention_bias": True}, {"head_dim": 64}],
    "gemma2": [{"tie_word_embeddings": False}, {"attention_bias": True}, {"head_dim": 64, "num_key_value_heads": 4}],
    "gpt2": [{"n_inner": None}, {"tie_word_embeddings": False}, {"n_positions": 1024}],
    "gpt_neox": [{"tie_word_embeddings": True}, {"attention_bias": False}, {"intermediate_size": 512}],
    "phi": [{"qk_layernorm": True}, {"tie_word_embeddings": True}, {"num_key_value_heads": 2}],
    "gemma3_text": [{"tie_word_embeddings": False}, {"head_dim": 64, "num_key_value_heads": 4}],
    "olmo2": [{"tie_word_embeddings": True}, {"num_key_value_heads": 4}],
    "phi3": [{"tie_word_embeddings": True}, {"num_key_value_heads": 4}],
    "qwen3_moe": [{"tie_word_embeddings": True}, {"num_experts": 4, "moe_intermediate_size": 32}],
    "mixtral": [{"tie_word_embeddings": True}, {"num_local_experts": 8}],
    "gpt_oss": [{"num_local_experts": 8}],
}
_CASES = [(f, {}) for f in FAMILIES] + [(f, v) for f in FAMILIES for v in _VARIATIONS[f]]


@pytest.mark.parametrize(("family", "overrides"), _CASES, ids=[f"{f}-{'-'.join(v) or 'base'}" for f, v in _CASES])
def test_parameter_count_equals_hf(family, overrides):
    config = {"model_type": family, **_BASE[family], "vocab_size": 512, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, **overrides}
    hf = AutoConfig.for_model(family, **{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(0)
    real = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    assert count_params(config).total == real
    assert count_params(hf).total == real  # a transformers config works as well as the dict


@pytest.mark.parametrize("config", [LLAMA_8B, QWEN3_32B, LLAMA_70B], ids=["llama-8b", "qwen3-32b", "llama-70b"])
def test_parameter_count_equals_hf_at_full_size(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(to_config(config))
    assert count_params(config).total == sum(p.numel() for p in model.parameters())


def test_tables_cover_every_family_and_scheme():
    assert set(supported_model_types()) <= set(LAYOUTS)  # and the families only the sizer prices (test_sizing_moe.py)
    assert set(SCHEMES) == set(quantization.SCHEMES)


# -------------------------------------------------------------------------------- three real configs

def test_llama_8b_bf16_on_one_h100(tmp_path):
    result = estimate(write_config(tmp_path, LLAMA_8B), backend="vllm", gpu="H100-80GB")
    # embed = lm_head = 128256 * 4096 = 525,336,576 each (untied)
    # per layer: q 4096*4096 = 16,777,216; k = v = 4096*1024 = 4,194,304; o 16,777,216  -> 41,943,040
    #            mlp 3 * 4096 * 14336 = 176,160,768; norms 2 * 4096 = 8,192              -> 218,112,000
    # 32 layers 6,979,584,000 + 2 * 525,336,576 + final norm 4,096                      = 8,030,261,248
    params = 32 * (41_943_040 + 176_160_768 + 8_192) + 2 * 525_336_576 + 4_096
    assert params == 8_030_261_248 == result.params
    weights = params * 2  # bf16                                                         = 16,060,522,496 (14.96 GiB)
    kv_token = 2 * 32 * 8 * 128 * 2  # 131,072 bytes
    kv = kv_token * 131_072  # max_model_len defaults to max_position_embeddings        = 17,179,869,184 (16 GiB)
    per_gpu = weights + kv + 2 * GiB  # + overhead                                       = 35,387,875,328 (32.96 GiB)
    assert result.max_model_len == 131_072
    assert within(result.weight_bytes, weights) and within(result.kv_bytes, kv)
    assert result.kv_bytes_per_token == kv_token
    assert within(result.per_gpu_bytes, per_gpu)
    assert result.gpu_capacity_bytes == 81_559 * 2**20 and result.budget_bytes == int(0.9 * 81_559 * 2**20)
    assert result.fits and result.capture_bytes == 0


def test_qwen3_32b_bf16_does_not_fit_one_h100_but_fits_an_h200(tmp_path):
    folder = write_config(tmp_path, QWEN3_32B)
    result = estimate(folder)
    # embed = lm_head = 151936 * 5120 = 777,912,320 each (untied)
    # per layer: q 5120*8192 = 41,943,040; k = v = 5120*1024 = 5,242,880; o 8192*5120 = 41,943,040 -> 94,371,840
    #            q_norm + k_norm 2 * 128 = 256; mlp 3 * 5120 * 25600 = 393,216,000; norms 2 * 5120 = 10,240
    # 64 layers * 487,598,336 = 31,206,293,504 + 2 * 777,912,320 + final norm 5,120          = 32,762,123,264
    params = 64 * (94_371_840 + 256 + 393_216_000 + 10_240) + 2 * 777_912_320 + 5_120
    assert params == 32_762_123_264 == result.params
    weights = params * 2  # 65,524,246,528 bytes (61.02 GiB)
    kv = (2 * 64 * 8 * 128 * 2) * 40_960  # 262,144 bytes/token x 40,960 tokens = 10,737,418,240 (10 GiB)
    per_gpu = weights + kv + 2 * GiB  # 78,409,148,416 bytes (73.02 GiB) > 0.9 x 79.65 GiB = 71.68 GiB
    assert within(result.weight_bytes, weights) and within(result.kv_bytes, kv)
    assert within(result.per_gpu_bytes, per_gpu)
    assert not result.fits
    assert 0 < result.max_len_that_fits < 40_960  # the report offers the longest context that does fit
    assert "fits: NO" in result.report() and f"{result.max_len_that_fits:,}" in result.report()
    assert estimate(folder, gpu="H200-141GB").fits  # 73.02 GiB < 0.9 x 140.40 GiB
    assert estimate(folder, num_gpus=2).fits


def test_llama_70b_fp8_weights_fp8_kv_on_two_h100s(tmp_path):
    result = estimate(write_config(tmp_path, LLAMA_70B), backend="vllm", quantization="fp8", kv_cache_dtype="fp8",
                      num_gpus=2, gpu="H100-80GB")
    # embed = lm_head = 128256 * 8192 = 1,050,673,152 each
    # per layer linear: q 8192*8192 = 67,108,864; k = v = 8192*1024 = 8,388,608; o 67,108,864; mlp 3*8192*28672
    #                   = 704,643,072 -> 855,638,016; norms 2 * 8192 = 16,384
    linear = 80 * 855_638_016  # 68,451,041,280 params at 1 byte
    scales = 80 * 7 * 4  # one fp32 scale per matrix: 2,240 bytes
    norms = 80 * 16_384 + 8_192  # 1,318,912 params at bf16, on both GPUs
    embeddings = 2 * 1_050_673_152  # 2,101,346,304 params at bf16
    assert result.params == linear + norms + embeddings == 70_553_706_496
    weights = linear + scales + 2 * (norms + embeddings)  # 72,656,373,952 bytes (67.67 GiB)
    weights_per_gpu = 2 * norms + (weights - 2 * norms) / 2  # 36,329,505,888 (33.83 GiB)
    kv = (2 * 80 * 8 * 128 * 1) * 131_072  # fp8: 163,840 bytes/token x 131,072 = 21,474,836,480 (20 GiB)
    per_gpu = weights_per_gpu + kv / 2 + 2 * GiB  # 49,214,407,776 (45.83 GiB)
    assert within(result.weight_bytes, weights) and within(result.weight_bytes_per_gpu, weights_per_gpu)
    assert within(result.kv_bytes, kv) and within(result.per_gpu_bytes, per_gpu)
    assert result.fits
    assert ("quantization=\"fp8\", kv_cache_dtype=\"fp8\", num_gpus=2" in result.snippet)
