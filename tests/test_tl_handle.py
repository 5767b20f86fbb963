"""What a TransformerLens user reaches for on the handle: cfg, tokenizer, to_str_tokens, to_single_token,
get_token_position and a short repr, checked against config.json and the tokenizer read independently."""

import json

import pytest
from transformers import AutoTokenizer

from interp_engine.errors import SpecError


def test_cfg_is_config_json_under_tl_names_and_repr_is_short(eager, tiny_path):
    for family, norm, positional, act in [("llama", "rmsnorm", "rotary", "silu"),
                                          ("gpt2", "layernorm", "learned", "gelu_new"),
                                          ("gemma2", "gemma_rmsnorm", "rotary", "gelu_pytorch_tanh")]:
        _check_cfg(eager(family), tiny_path(family), family, norm, positional, act)
    text = repr(eager("llama"))
    assert len(text) < 160 and "backend='eager'" in text and "llama 3L d_model=128" in text, text


def _check_cfg(model, folder, family, norm, positional, act):
    raw = json.loads((folder / "config.json").read_text())
    get = lambda *keys: next(raw[k] for k in keys if raw.get(k) is not None)  # noqa: E731
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.d_vocab, cfg.n_ctx) == (
        get("num_hidden_layers", "n_layer"), get("hidden_size", "n_embd"), get("num_attention_heads", "n_head"),
        raw["vocab_size"], get("max_position_embeddings", "n_positions"))
    assert cfg.d_mlp == get("intermediate_size", "n_inner")
    assert cfg.n_kv_heads == raw.get("num_key_value_heads", cfg.n_heads)
    assert cfg.d_head == raw.get("head_dim", cfg.d_model // cfg.n_heads)
    assert (cfg.family, cfg.normalization, cfg.positional, cfg.act_fn) == (family, norm, positional, act)
    with pytest.raises(AttributeError):
        cfg.n_layers = 1


def test_tokens_as_strings_match_the_tokenizer(eager, tiny_path):
    model = eager("llama")
    reference = AutoTokenizer.from_pretrained(str(tiny_path("llama")))
    text = "Paris is the capital of France"
    pieces = model.to_str_tokens(text, prepend_bos=False)
    assert "".join(pieces) == text and len(pieces) == len(reference(text)["input_ids"]) - (
        reference(text)["input_ids"][0] == reference.bos_token_id)
    assert model.tokenizer.get_vocab() == reference.get_vocab()
    assert model.to_str_tokens(model.to_tokens([text, text])) == [model.to_str_tokens(text)] * 2
    assert model.to_str_tokens(text)[0] == reference.bos_token
    capital = model.to_single_token(" capital")
    assert capital == reference.convert_tokens_to_ids(reference.tokenize(" capital"))[0]
    assert model.get_token_position(" capital", text) == model.to_str_tokens(text).index(" capital")
    assert model.get_token_position(capital, model.to_tokens(text + text), mode="last") == \
        len(model.to_str_tokens(text + text)) - 1 - model.to_str_tokens(text + text)[::-1].index(" capital")


def test_bad_tokens_are_refused_with_the_fix(eager):
    model = eager("llama")
    for text, message, remedy in [
            ("Paris is", "'Paris is' is 2 tokens, ['Paris', ' is'], not one.", "model.to_single_token('Paris')"),
            ("", "'' is not a token in the vocabulary", "model.to_str_tokens(text) shows how it splits")]:
        with pytest.raises(SpecError) as info:
            model.to_single_token(text)
        assert message in str(info.value) and "Fix:" in str(info.value) and remedy in str(info.value)
    with pytest.raises(SpecError, match="does not occur in the 3 tokens"):
        model.get_token_position(" capital", "Paris is")
