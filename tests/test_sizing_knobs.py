"""The sizer's knobs (quantization schemes, KV dtype, vllm-static's declared taps and SAEs, replicated KV heads)
priced against the buffers they allocate, and the snippet: the load_model call it prints, as load_model accepts it."""

import ast
import dataclasses
import inspect
import json

import pytest
import torch

from interp_engine.addresses import Address
from interp_engine.errors import SpecError
from interp_engine.handle import ModelHandle
from interp_engine.loading import load_model
from interp_engine.sizing import count_params, estimate, estimate_from_config, kv_bytes_per_token
from interp_engine.tiny import _BASE
from tests.sizing_configs import LLAMA_8B, QWEN3_32B

pytestmark = pytest.mark.usefixtures("no_network")  # conftest: the sizer reads config.json and nothing else


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
