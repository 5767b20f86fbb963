"""The GPU sizer: parameter counts equal HF's for every family, three real configs priced against hand sums, the
snippet is a load_model call load_model accepts, the CLI, and every bad input refused with its fix."""

import ast
import dataclasses
import inspect
import json
import socket

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from interp_engine import quantization
from interp_engine.addresses import Address
from interp_engine.arch import supported_model_types
from interp_engine.cli import main
from interp_engine.errors import BackendError, LoadError, PointError, SpecError
from interp_engine.handle import ModelHandle
from interp_engine.loading import load_model
from interp_engine.sizing import (GPUS_MIB, LAYOUTS, OVERHEAD_BYTES, SCHEMES, count_params, estimate,
                                  estimate_from_config, kv_bytes_per_token, to_config)
from interp_engine.tiny import _BASE, FAMILIES

GiB = 2**30

# Real configs as their config.json files hold them (the fields the sizer reads, plus the usual others).
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "bos_token_id": 128000, "eos_token_id": 128001,
}
QWEN3_32B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 5120, "num_hidden_layers": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 25600,
    "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000,
    "bos_token_id": 151643, "eos_token_id": 151645,
}
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "num_key_value_heads": 8, "intermediate_size": 28672}


def _write(tmp_path, config: dict, name: str = "model"):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _within(got: int, hand: int, rel: float = 0.03) -> bool:
    return abs(got - hand) <= rel * hand


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """The sizer reads config.json and nothing else: any connection attempt fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("the sizer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)


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
    result = estimate(_write(tmp_path, LLAMA_8B), backend="vllm", gpu="H100-80GB")
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
    assert _within(result.weight_bytes, weights) and _within(result.kv_bytes, kv)
    assert result.kv_bytes_per_token == kv_token
    assert _within(result.per_gpu_bytes, per_gpu)
    assert result.gpu_capacity_bytes == 81_559 * 2**20 and result.budget_bytes == int(0.9 * 81_559 * 2**20)
    assert result.fits and result.capture_bytes == 0


def test_qwen3_32b_bf16_does_not_fit_one_h100_but_fits_an_h200(tmp_path):
    folder = _write(tmp_path, QWEN3_32B)
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
    assert _within(result.weight_bytes, weights) and _within(result.kv_bytes, kv)
    assert _within(result.per_gpu_bytes, per_gpu)
    assert not result.fits
    assert 0 < result.max_len_that_fits < 40_960  # the report offers the longest context that does fit
    assert "fits: NO" in result.report() and f"{result.max_len_that_fits:,}" in result.report()
    assert estimate(folder, gpu="H200-141GB").fits  # 73.02 GiB < 0.9 x 140.40 GiB
    assert estimate(folder, num_gpus=2).fits


def test_llama_70b_fp8_weights_fp8_kv_on_two_h100s(tmp_path):
    result = estimate(_write(tmp_path, LLAMA_70B), backend="vllm", quantization="fp8", kv_cache_dtype="fp8",
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
    assert _within(result.weight_bytes, weights) and _within(result.weight_bytes_per_gpu, weights_per_gpu)
    assert _within(result.kv_bytes, kv) and _within(result.per_gpu_bytes, per_gpu)
    assert result.fits
    assert ("quantization=\"fp8\", kv_cache_dtype=\"fp8\", num_gpus=2" in result.snippet)


# ------------------------------------------------------------------------------------------ the knobs

def test_bnb_schemes_price_linear_layers_and_keep_embeddings_at_model_dtype():
    linear = 32 * 218_103_808  # 8B: every block's q, k, v, o, gate, up, down weights: 6,979,321,856 params
    rows = 32 * (4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096)  # output rows, 1,376,256
    rest = (2 * 525_336_576 + 32 * 8192 + 4096) * 2  # embeddings, lm_head, norms at bf16
    # NF4 with double quant: 0.5 byte + an 8-bit absmax per 64 params (109,051,904) + an fp32 one per 64 x 256
    # params (425,984 of them)
    nf4 = linear // 2 + linear // 64 + 4 * (linear // 16_384)
    assert linear // 64 == 109_051_904 and linear // 16_384 == 425_984
    four = estimate_from_config(LLAMA_8B, backend="eager", quantization="bnb-4bit")
    assert four.weight_bytes == nf4 + rest
    assert estimate_from_config(LLAMA_8B, backend="vllm", quantization="bnb-4bit").weight_bytes == nf4 + rest
    eight = estimate_from_config(LLAMA_8B, backend="eager", quantization="bnb-8bit")
    assert eight.weight_bytes == linear + rows * 4 + rest  # 1 byte + one fp32 scale per row


def test_kv_bytes_per_token_follows_the_kv_dtype_and_the_model_dtype():
    assert kv_bytes_per_token(LLAMA_8B, None) == kv_bytes_per_token(LLAMA_8B, "auto") == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(LLAMA_8B, "fp8") == 2 * 32 * 8 * 128
    fp32 = {**LLAMA_8B, "torch_dtype": "float32"}
    # load_model hands vLLM the checkpoint's dtype explicitly, so an fp32 checkpoint's cache is fp32 on every backend
    assert kv_bytes_per_token(fp32, "auto") == 2 * 32 * 8 * 128 * 4
    assert kv_bytes_per_token(fp32, "auto", dtype="bfloat16") == 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_token(LLAMA_8B, "auto", dtype="float32") == 2 * 32 * 8 * 128 * 4


def test_a_checkpoint_that_ships_quantized_is_priced_as_shipped():
    fp8 = {**LLAMA_8B, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    shipped = estimate_from_config(fp8, repo_id="org/llama-8b-fp8")
    assert shipped.weight_bytes == estimate_from_config(LLAMA_8B, quantization="fp8").weight_bytes
    assert "quantization" not in shipped.snippet and any("ships quantized (fp8)" in n for n in shipped.notes)
    with pytest.raises(SpecError, match="already ships quantized") as caught:
        estimate_from_config(fp8, repo_id="org/llama-8b-fp8", quantization="fp8")
    assert "Fix: drop quantization=" in str(caught.value)
    awq = {**LLAMA_8B, "quantization_config": {"quant_method": "awq", "bits": 4}}
    upper = estimate_from_config(awq, repo_id="org/llama-8b-awq")
    assert upper.weight_bytes == estimate_from_config(LLAMA_8B).weight_bytes
    assert any("ships quantized (awq)" in n and "upper bound" in n for n in upper.notes)


def test_static_points_price_the_buffers_the_taps_allocate():
    """One step of rows per tapped point at this rank's width, plus the final norm's output (logits come from
    it); an attention pattern is recomputed from its layer's q and k, and attn_result from its layer's z, so
    those are what they cost."""
    points = ["resid_post.10", "mlp_act.3", "q.0", "k.-1"]
    widths = 5120 + 25600 + 64 * 128 + 8 * 128 + 5120
    on_h100 = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=points, max_model_len=4096)
    assert on_h100.capture_bytes == 16_384 * widths * 2  # vLLM's 16k-token step on an 80 GB card, bf16
    on_a100 = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=points, gpu="A100-80GB")
    assert on_a100.capture_bytes == 8_192 * widths * 2  # vLLM keeps A100s at 8k tokens per step
    sharded = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=points, num_gpus=4)
    assert sharded.capture_bytes == 16_384 * (5120 + 25600 // 4 + 16 * 128 + 2 * 128 + 5120) * 2
    auto = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points="auto", num_gpus=4)
    assert auto.static_points == tuple(f"resid_post.{layer}" for layer in range(64))
    assert auto.capture_bytes == 65 * 16_384 * 5120 * 2  # the residual stream is whole on every rank
    scores = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=["attn_probs.0"], max_model_len=1024)
    assert scores.capture_bytes == 16_384 * (64 * 128 + 8 * 128 + 5120) * 2
    tl = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=["attn_result.0", "mlp_pre.1"],
                              num_gpus=4)
    assert tl.capture_bytes == 16_384 * (16 * 128 + 25600 // 4 + 5120) * 2  # z's heads, not n_heads x d_model


def test_static_writes_price_a_mul_and_an_add_buffer_each():
    """vllm-static gives each declared write two buffers (mul and add), a step of rows at this rank's width,
    beside the read buffers; a write alone still has the final norm's read buffer (logits come from it)."""
    reads = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=["resid_post.10"])
    writes = ["resid_post.10", "mlp_act.3", "q.0", "k.-1"]
    both = estimate_from_config(QWEN3_32B, backend="vllm-static", static_points=["resid_post.10"],
                                static_writes=writes)
    assert both.capture_bytes - reads.capture_bytes == 2 * 16_384 * (5120 + 25600 + 64 * 128 + 8 * 128) * 2
    assert both.static_writes == ("resid_post.10", "mlp_act.3", "q.0", "k.63")
    sharded = estimate_from_config(QWEN3_32B, backend="vllm-static", static_writes=writes, num_gpus=4)
    assert sharded.capture_bytes == 16_384 * (5120 + 2 * (5120 + 25600 // 4 + 16 * 128 + 2 * 128)) * 2
    auto = estimate_from_config(QWEN3_32B, backend="vllm-static", static_writes="auto")
    assert auto.capture_bytes == (1 + 2 * 64) * 16_384 * 5120 * 2
    assert 'static_writes="auto"' in auto.snippet and "64 writes x 2 buffers (mul, add) x 16,384" in auto.report()
    listed = _call(both.snippet)
    assert {k.arg: ast.literal_eval(k.value) for k in listed.keywords}["static_writes"] == [
        "resid_post.10", "mlp_act.3", "q.0", "k.-1"]


def _nbytes(tap) -> int:
    """The bytes of every tensor a tap object holds (its buffers), however nested."""
    def walk(x):
        if isinstance(x, torch.Tensor):
            return x.nbytes
        if isinstance(x, dict):
            return sum(map(walk, x.values()))
        if isinstance(x, list | tuple):
            return sum(map(walk, x))
        return walk(vars(x)) if hasattr(x, "__dict__") and not isinstance(x, type) else 0
    return walk(vars(tap))


def test_saes_in_static_writes_price_the_buffers_their_taps_allocate():
    """SAEs in static_writes (a bare relu SAE: clamp slots; a bare topk one and an S.Splice: the whole SAE) are
    priced at the bytes of the very tap objects a worker builds (static_clamp.ClampTap, static_splice.SpliceTap,
    here on CPU at one step's rows) plus the largest dense encode of a step; the snippet names them. At
    num_gpus=2 an SAE of a sharded point is served (its tap gathers it) and one of router_logits is refused, as
    load_model refuses it."""
    from interp_engine import spec as S
    from interp_engine.backends.vllm.static_clamp import ClampTap
    from interp_engine.backends.vllm.static_splice import SpliceTap
    from interp_engine.sae_taps import declared_saes
    from interp_engine.sizing_shapes import read_sizes
    from interp_engine.sizing import to_config
    from tests.conftest import random_sae

    config = {"model_type": "llama", **_BASE["llama"], "vocab_size": 512}  # d_model 128, 4 heads of 32, d_mlp 256
    relu = random_sae(128, 1, 1)
    topk = dataclasses.replace(random_sae(256, 0, 2, activation="topk", k=4), reads=Address.parse("mlp_act.0"))
    z = dataclasses.replace(random_sae(128, 0, 3), reads=Address.parse("z.2"))
    writes = ["resid_post.1", relu, topk, S.Splice(z)]
    plain = estimate_from_config(config, backend="vllm-static", static_writes=["resid_post.1", "mlp_act.0", "z.2"])
    priced = estimate_from_config(config, backend="vllm-static", static_writes=writes)
    assert priced.static_writes == plain.static_writes
    rows = 16_384
    _, _, declared = declared_saes(writes, read_sizes(to_config(config)))
    taps = [ClampTap(rows, 128, "cpu"), ClampTap(rows, 256, "cpu"), ClampTap(rows, 128, "cpu"),
            SpliceTap(declared[:1], rows, "cpu"), SpliceTap(declared[1:], rows, "cpu")]
    buffers = sum(map(_nbytes, taps))
    assert priced.sae_bytes == buffers + rows * 1024 * 4 and buffers > 3 * 2 * rows * 64 * 4  # + topk's encode
    assert priced.capture_bytes - plain.capture_bytes == priced.sae_bytes and "SAE taps" in priced.report()
    assert 'static_writes=["resid_post.1", saes[0], saes[1], S.Splice(saes[2])])' in priced.snippet
    assert any("saes[k]" in note for note in priced.notes)
    assert estimate_from_config(config, backend="vllm-static", static_writes=writes, num_gpus=2).sae_bytes > 0
    moe = {"model_type": "mixtral", **_BASE["mixtral"], "vocab_size": 512}  # 4 experts
    router = dataclasses.replace(random_sae(4, 0, 4), reads=Address.parse("router_logits.1"))
    assert estimate_from_config(moe, backend="vllm-static", static_writes=[router]).sae_bytes > 0
    with pytest.raises(SpecError, match=r"(?s)router_logits.1 at num_gpus=2.*served at the residual stream.*Fix:"):
        estimate_from_config(moe, backend="vllm-static", static_writes=[router], num_gpus=2)


def test_kv_heads_are_replicated_when_gpus_outnumber_them():
    config = {"model_type": "llama", **_BASE["llama"], "vocab_size": 512}  # 4 heads, 2 KV heads
    one, four = (estimate_from_config(config, num_gpus=n) for n in (1, 4))
    assert four.kv_bytes_per_gpu == one.kv_bytes_per_gpu // 2  # each rank keeps one of the two KV heads


def test_tiny_checkpoint_fits_and_its_snippet_loads_lazily(tiny_path):
    folder = tiny_path("llama")
    result = estimate(str(folder), backend="eager", dtype="float32", gpu="RTX4090-24GB")
    assert result.fits and result.params == count_params(json.loads((folder / "config.json").read_text())).total
    namespace: dict = {}
    exec(result.snippet, namespace)  # noqa: S102 - the point of the test: the printed call runs
    model = namespace["model"]
    assert isinstance(model, ModelHandle) and not model.is_loaded
    assert model.backend == "eager" and model.dtype == torch.float32 and model.n_layers == 3
    via_file = estimate(str(folder / "config.json"), backend="eager")  # a direct config.json path names its folder
    assert via_file.repo_id == str(folder)


def _call(snippet: str) -> ast.Call:
    calls = [n for n in ast.walk(ast.parse(snippet)) if isinstance(n, ast.Call)]
    assert len(calls) == 1 and isinstance(calls[0].func, ast.Name) and calls[0].func.id == "load_model"
    return calls[0]


@pytest.mark.parametrize("knobs", [
    {},
    {"backend": "vllm", "quantization": "fp8", "kv_cache_dtype": "fp8", "num_gpus": 2},
    {"backend": "vllm-static", "static_points": ["resid_post.10", "z.-1"], "max_model_len": 4096,
     "gpu_memory_utilization": 0.85},
    {"backend": "vllm-static", "static_points": "auto", "dtype": "float16"},
    {"backend": "vllm-static", "static_points": ["resid_post.10"], "static_writes": ["resid_post.10", "mlp_act.3"]},
    {"backend": "vllm-generate", "kv_cache_dtype": "fp8_e5m2", "concurrency": 8, "max_model_len": 2048},
    {"backend": "eager", "quantization": "bnb-4bit", "max_model_len": 4096, "gpu_memory_utilization": 0.5},
], ids=["defaults", "fp8-tp2", "static-list", "static-auto", "static-writes", "generate", "eager-bnb"])
def test_snippet_is_the_priced_load_model_call(knobs):
    result = estimate_from_config(LLAMA_8B, repo_id="meta-llama/Llama-3.1-8B", **knobs)
    call = _call(result.snippet)
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert set(keywords) <= set(inspect.signature(load_model).parameters)
    assert ast.literal_eval(call.args[0]) == "meta-llama/Llama-3.1-8B"
    assert keywords["backend"] == knobs.get("backend", "vllm")  # always there
    vllm_only = {"max_model_len", "gpu_memory_utilization", "kv_cache_dtype", "static_points"}
    expected = {k: v for k, v in knobs.items() if k != "concurrency"
                and not (knobs.get("backend") == "eager" and k in vllm_only)}
    assert keywords == {"backend": "vllm", **expected}


def test_snippet_leaves_out_what_equals_the_default():
    result = estimate_from_config(LLAMA_8B, repo_id="m", kv_cache_dtype="auto", num_gpus=1, max_model_len=131_072,
                                  gpu_memory_utilization=0.9, dtype="auto")
    assert {k.arg for k in _call(result.snippet).keywords} == {"backend"}


# ----------------------------------------------------------------------------------------------- CLI

def test_cli_prints_the_report(tmp_path, capsys):
    folder = _write(tmp_path, LLAMA_70B)
    code = main(["size", str(folder), "--backend", "vllm", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                 "--num-gpus", "2", "--gpu", "H100-80GB"])
    out = capsys.readouterr().out
    assert code == 0 and "fits: yes" in out and "70.55 B parameters" in out
    assert f'load_model("{folder}", backend="vllm", quantization="fp8", kv_cache_dtype="fp8", num_gpus=2)' in out


def test_cli_static_points_and_a_misfit(tmp_path, capsys):
    folder = _write(tmp_path, QWEN3_32B)
    assert main(["size", str(folder), "--backend", "vllm-static", "--static-points", "resid_post.3, mlp_out.4",
                 "--max-model-len", "8192", "--concurrency", "2", "--gpu-memory-utilization", "0.8",
                 "--gpu", "H200-141GB"]) == 0
    out = capsys.readouterr().out
    assert "static_points=[\"resid_post.3\", \"mlp_out.4\"]" in out and "gpu_memory_utilization=0.8" in out
    assert main(["size", str(folder), "--backend", "vllm-static", "--static-points", "auto", "--static-writes",
                 "resid_post.3", "--gpu", "H200-141GB"]) == 0
    out = capsys.readouterr().out
    assert 'static_points="auto", static_writes=["resid_post.3"]' in out
    assert "64 points + 1 writes x 2 buffers (mul, add)" in out
    assert main(["size", str(folder), "--gpu", "a100-40gb"]) == 1  # names match case-insensitively
    assert "fits: NO" in capsys.readouterr().out


def test_cli_bad_input_exits_2_with_the_fix(tmp_path, capsys):
    assert main(["size", str(_write(tmp_path, LLAMA_8B)), "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert "'H100-80GB'" in err and "Fix:" in err and "A40-48GB" in err


# ---------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize(("knobs", "error", "words"), [
    ({"quantization": "fp4"}, SpecError, ["'fp8'", "Schemes"]),
    ({"quantization": "fp8", "backend": "eager"}, BackendError, ["vLLM backend", "FP8"]),
    ({"quantization": "bnb-4bit", "backend": "vllm", "dtype": "float32"}, SpecError, ["16 bits", "bfloat16"]),
    ({"quantization": "bnb-8bit", "backend": "vllm-static"}, BackendError, ["eager"]),
    ({"kv_cache_dtype": "fp9"}, SpecError, ["'fp8'", "KV cache dtypes"]),
    ({"kv_cache_dtype": "fp8", "backend": "eager"}, BackendError, ["vLLM setting"]),
    ({"num_gpus": 0}, SpecError, ["num_gpus=0", "at least 1"]),
    ({"num_gpus": 3}, SpecError, ["tensor parallelism", "[1, 2, 4, 8, 16, 32]"]),
    ({"concurrency": 0}, SpecError, ["concurrency=0"]),
    ({"gpu_memory_utilization": 0}, SpecError, ["(0, 1]"]),
    ({"gpu_memory_utilization": -0.5}, SpecError, ["(0, 1]"]),
    ({"gpu_memory_utilization": 1.2}, SpecError, ["(0, 1]"]),
    ({"max_model_len": 131_073}, SpecError, ["limit of 131072", "max_model_len=131072"]),
    ({"max_model_len": 0}, SpecError, ["max_model_len=0"]),
    ({"gpu": "H100"}, SpecError, ["'H100-80GB'", "RTX4090-24GB"]),
    ({"gpu": "B300"}, SpecError, ["Known GPUs"]),
    ({"backend": "auto"}, BackendError, ["name the backend"]),
    ({"backend": "vlm"}, BackendError, ["'vllm'"]),
    ({"static_points": "auto"}, BackendError, ["vllm-static"]),
    ({"static_writes": ["resid_post.3"]}, BackendError, ["static_writes=", "vllm-static"]),
    ({"backend": "eager", "static_writes": "auto"}, BackendError, ["static_writes=", "vllm-static"]),
    ({"backend": "vllm-static", "static_writes": ["logits"]}, SpecError, ["only on the eager backend"]),
    ({"backend": "vllm-static", "static_writes": ["resid_post.32"]}, PointError, ["0..31"]),
    ({"backend": "vllm-static", "static_points": "resid_post.3"}, SpecError, ["static_points=[\"resid_post.10\"]"]),
    ({"backend": "vllm-static", "static_points": ["resid_pst.3"]}, PointError, ["'resid_post'"]),
    ({"backend": "vllm-static", "static_points": ["resid_post.32"]}, PointError, ["0..31"]),
    ({"dtype": "bf61"}, SpecError, ["dtype="]),
])
def test_bad_knobs_are_refused_with_the_fix(knobs, error, words):
    with pytest.raises(error) as caught:
        estimate_from_config(LLAMA_8B, repo_id="meta-llama/Llama-3.1-8B", **knobs)
    assert "Fix:" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_a_folder_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        estimate(tmp_path / "empty")


def test_an_unreadable_config_json_is_refused(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="cannot be read as JSON"):
        estimate(folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "hidden_size": "big"}))
    with pytest.raises(LoadError, match="not a valid llama config"):
        estimate(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(TypeError, match="config.json dict"):
        estimate(folder)


def test_an_uncovered_architecture_is_refused(tmp_path):
    with pytest.raises(LoadError, match="covered family"):
        estimate(_write(tmp_path, {"model_type": "mamba", "hidden_size": 8}))


def test_a_repo_id_neither_local_nor_cached_is_refused_without_download(tmp_path, monkeypatch, offline_hub):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoadError) as caught:
        estimate("meta-llama/Llama-3.1-8B")
    message = str(caught.value)
    assert "no download was attempted" in message and "local folder" in message and "config.json" in message
    with pytest.raises(LoadError, match="no download"):
        estimate("./not/a/folder/config.json")


def test_a_repo_id_in_the_local_cache_is_read_from_there(tmp_path, monkeypatch, offline_hub):
    hub = offline_hub
    snapshot = hub / "models--meta-llama--Llama-3.1-8B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_8B))
    (hub / "models--meta-llama--Llama-3.1-8B" / "refs").mkdir()
    (hub / "models--meta-llama--Llama-3.1-8B" / "refs" / "main").write_text("a" * 40)
    monkeypatch.chdir(tmp_path)
    result = estimate("meta-llama/Llama-3.1-8B", max_model_len=8192)
    assert result.params == 8_030_261_248
    assert 'load_model("meta-llama/Llama-3.1-8B", backend="vllm", max_model_len=8192)' in result.snippet


def test_gpu_table_names_the_cards_the_issue_lists():
    for name in ("H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "A40-48GB", "L40S-48GB", "RTX4090-24GB"):
        assert name in GPUS_MIB
    assert OVERHEAD_BYTES == 2 * GiB
