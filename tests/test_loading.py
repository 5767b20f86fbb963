"""load_model: lazy construction, a frozen handle, dims from the config, points, tokens, the lifecycle, offline
resolution of repo ids and keyword passthrough on eager (backend selection and vLLM keywords: test_selection.py)."""

import asyncio
import dataclasses
import hashlib
import shutil

import pytest
import torch
from transformers import AutoConfig

from interp_engine import Address, capture, load_model
from interp_engine.addresses import POINTS
from interp_engine.errors import LoadError, SpecError
from interp_engine.tiny import build_tiny_model
from tests.conftest import PROMPTS



def _resid(model, text: str = PROMPTS[1], layer: int = -1) -> torch.Tensor:
    return capture(model, model.to_tokens(text), [Address("resid_post", layer)], progress=False)[
        Address("resid_post", layer)]


# ------------------------------------------------------------------------------------------- lifecycle

def test_construction_is_lazy_and_warmup_loads(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="eager")
    assert model.is_loaded is False
    assert model.n_layers == 3  # dims come from config.json alone
    assert asyncio.run(model.warmup()) is model
    assert model.is_loaded is True


def test_load_model_reads_no_weights(tiny_path, tmp_path):
    folder = shutil.copytree(tiny_path("llama"), tmp_path / "no-weights")
    (folder / "model.safetensors").unlink()
    model = load_model(str(folder), backend="eager")
    assert not model.is_loaded
    assert model.d_model == 128


def test_capture_on_an_unloaded_handle_loads_lazily(tiny_path, eager):
    model = load_model(str(tiny_path("llama")), backend="eager", attn_implementation="eager", device="cpu")
    assert not model.is_loaded
    out = _resid(model)
    assert model.is_loaded
    torch.testing.assert_close(out, _resid(eager("llama")))


def test_shutdown_unloads_and_the_handle_reloads_lazily(tiny_path):
    async def lifecycle():
        model = load_model(str(tiny_path("gpt2")), backend="eager", device="cpu")
        await model.warmup()
        before = _resid(model)
        await model.shutdown()
        return model, before

    model, before = asyncio.run(lifecycle())
    assert not model.is_loaded
    assert model.runtime.model is None
    after = _resid(model)
    assert model.is_loaded
    assert torch.equal(before, after)


# ---------------------------------------------------------------------------------------------- frozen

@pytest.mark.parametrize("name", ["name", "backend", "device", "dtype", "attn_implementation", "requires_grad",
                                  "arch", "dims", "runtime"])
def test_handle_fields_cannot_be_set_or_deleted(eager, name):
    model = eager("llama")
    before = getattr(model, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(model, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(model, name)
    assert getattr(model, name) is before


def test_dims_are_frozen(eager):
    with pytest.raises(dataclasses.FrozenInstanceError):
        eager("llama").dims.n_layers = 7


@pytest.mark.parametrize("name", ["n_layers", "d_model", "not_a_field"])
def test_handle_properties_and_new_attributes_cannot_be_set(eager, name):
    with pytest.raises(AttributeError):
        setattr(eager("llama"), name, 7)


# ------------------------------------------------------------------------------------------------ dims

# Where each family's HF config keeps the MLP width (GPT-2 calls it n_inner).
D_MLP_KEY = {"gpt2": "n_inner", "qwen3_moe": "moe_intermediate_size"}  # MoE: one expert's width


def test_dims_equal_the_hf_config(family, tiny_path):
    path = tiny_path(family)
    config = AutoConfig.from_pretrained(str(path))
    model = load_model(str(path), backend="eager")
    n_heads = config.num_attention_heads
    assert model.n_layers == config.num_hidden_layers
    assert model.d_model == config.hidden_size
    assert model.n_heads == n_heads
    assert model.n_kv_heads == (getattr(config, "num_key_value_heads", None) or n_heads)
    assert model.d_head == (getattr(config, "head_dim", None) or config.hidden_size // n_heads)
    assert model.d_mlp == getattr(config, D_MLP_KEY.get(family, "intermediate_size"))
    assert model.d_vocab == config.vocab_size
    assert model.dims.n_experts == (getattr(config, "num_experts", None) or getattr(config, "num_local_experts", 0))


@pytest.mark.parametrize("family, overrides, expected", [
    pytest.param("qwen3", {"head_dim": 64}, {"d_head": 64, "d_model": 128, "n_heads": 4},
                 id="head_dim-not-d_model/n_heads"),
    pytest.param("llama", {"num_key_value_heads": 1}, {"n_kv_heads": 1, "n_heads": 4}, id="multi-query"),
    pytest.param("gpt2", {"n_inner": None}, {"d_mlp": 512}, id="gpt2-default-mlp-width"),
    pytest.param("gemma2", {"num_hidden_layers": 2, "vocab_size": 600}, {"n_layers": 2, "d_vocab": 600},
                 id="layers-and-vocab"),
])
def test_dims_follow_config_quirks_and_match_the_weights(tmp_path, family, overrides, expected):
    model = load_model(str(build_tiny_model(family, tmp_path / family, overrides=overrides)), backend="eager",
                       device="cpu")
    for dim, value in expected.items():
        assert getattr(model, dim) == value, dim
    tokens = model.to_tokens(PROMPTS[0])
    pos = tokens.shape[1]
    cache = capture(model, tokens, ["q.0", "k.0", "mlp_act.0", "logits"], progress=False)
    assert cache["q.0"].shape == (1, pos, model.n_heads, model.d_head)
    assert cache["k.0"].shape == (1, pos, model.n_kv_heads, model.d_head)
    assert cache["mlp_act.0"].shape == (1, pos, model.d_mlp)
    assert cache["logits"].shape == (1, pos, model.d_vocab)


# ---------------------------------------------------------------------------------------------- points

@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_points_lists_every_address(eager, family, attn):
    model = eager(family, attn=attn)
    patterns = {"attn_scores", "attn_probs"}
    expected = {Address(name) for name, info in POINTS.items() if not info.layered}
    expected |= {Address(name, layer) for name, info in POINTS.items() if info.layered and not model.arch.lacks(name)
                 for layer in range(model.n_layers) if attn == "eager" or name not in patterns}
    points = model.points()
    assert len(points) == len(set(points))
    assert set(points) == expected
    cache = capture(model, model.to_tokens(PROMPTS[1]), points, progress=False)
    assert set(cache) == expected


# ---------------------------------------------------------------------------------------------- tokens

@pytest.mark.parametrize("text", PROMPTS)
def test_to_tokens_and_to_string_round_trip(eager, text):
    model = eager("llama")
    bare = model.to_tokens(text, prepend_bos=False)
    assert bare.dtype == torch.long and bare.ndim == 2 and bare.shape[0] == 1
    assert model.to_string(bare[0]) == text
    assert model.to_string(bare[0].tolist()) == text
    assert model.to_string(bare) == [text]
    with_bos = model.to_tokens(text)
    assert with_bos[0, 0].item() == model.runtime.tokenizer.bos_token_id
    assert torch.equal(with_bos[0, 1:], bare[0])


def test_to_tokens_refuses_a_ragged_list_and_names_the_fix(eager):
    model = eager("llama")
    texts = [PROMPTS[0], "Paris"]
    lengths = [len(model.tokenize(t)) for t in texts]
    assert lengths[0] != lengths[1]
    with pytest.raises(SpecError) as info:
        model.to_tokens(texts)
    assert str(lengths) in str(info.value)
    assert "Fix: pass the list of strings straight to capture/steer/generate" in str(info.value)
    cache = capture(model, texts, ["resid_post.0"], progress=False)  # the fix it names works
    assert cache.lengths == tuple(lengths)


# ---------------------------------------------------------------------------------------- repo ids offline

def test_repo_id_resolves_from_the_local_hf_cache_offline(offline_hub, tiny_path, eager):
    commit = hashlib.sha1(b"tiny-org/tiny-llama").hexdigest()
    repo = offline_hub / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_path("llama"), repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)

    model = load_model("tiny-org/tiny-llama", backend="eager", attn_implementation="eager", device="cpu")
    assert model.name == "tiny-org/tiny-llama"
    assert not model.is_loaded
    out = _resid(model)
    assert out.shape == (1, model.to_tokens(PROMPTS[1]).shape[1], 128)
    torch.testing.assert_close(out, _resid(eager("llama")))


# ----------------------------------------------------------------------------------- keyword passthrough

def test_unknown_keywords_go_verbatim_to_from_pretrained(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="eager", device="cpu", use_cache=False, rms_norm_eps=1e-3)
    assert model.runtime.hf_kwargs == {"use_cache": False, "rms_norm_eps": 1e-3}
    asyncio.run(model.warmup())
    # from_pretrained turns leftover keywords into config overrides: seeing it there proves HF received it.
    assert model.runtime.model.config.rms_norm_eps == 1e-3
    assert _resid(model).shape[-1] == model.d_model


@pytest.mark.parametrize("text", ["{not json", '{"model_type": "llama", "hidden_size": "big"}'])
def test_an_unreadable_config_json_is_refused_before_loading(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(LoadError) as caught:
        load_model(str(tmp_path), backend="eager")
    assert "config.json of" in str(caught.value) and "cannot be read" in str(caught.value)
    assert "Fix: make config.json readable and valid JSON" in str(caught.value)
