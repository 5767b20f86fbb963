"""Kimi-K2.5/K2.6's multimodal wrapper (model_type kimi_k25, KimiK25ForConditionalGeneration) on the vLLM backends,
served as its DeepSeek-V3 text model: vLLM builds that model at `language_model` (arch/aliases.py's
VLLM_TEXT_MODEL), where the worker resolves DeepSeek's own layout, and starts with `language_model_only=True` (no
vision tower). The tiny checkpoint is the wrapper's real layout: transformers' own Kimi_K25Config around the tiny
DeepSeek with the real latent (tests/test_deepseek_vllm.py), its text weights under `language_model.`, a tiny
vision tower and projector from transformers' Kimi_K25ForConditionalGeneration beside them. The reference is eager
reading the same folder (tests/test_deepseek.py proves that equal to the unwrapped DeepSeek and to HF)."""

import json

import pytest

from interp_engine import load_model
from interp_engine.tiny import build_tiny_model
from tests.skips import requires
from tests.test_deepseek_vllm import REAL_LATENT, _served, check_every_point_and_write_equals_eager

VISION = dict(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32, pos_emb_height=4,
              pos_emb_width=4)


def build_kimi_k25(folder):
    """A tiny kimi_k25 checkpoint laid out as Kimi-K2.6's: config.json from transformers' Kimi_K25Config, the
    DeepSeek text weights under `language_model.`, the vision tower's and projector's beside them."""
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    text_folder = build_tiny_model("deepseek_v3", folder.parent / "kimi_text", overrides=REAL_LATENT)
    text = json.loads((text_folder / "config.json").read_text())
    config = Kimi_K25Config(text_config=text, vision_config=VISION, projection_hidden_size=VISION["hidden_size"],
                            tie_word_embeddings=False)
    wrapper = Kimi_K25ForConditionalGeneration(config)
    wrapper.save_pretrained(folder)  # config.json, and a vision tower and projector as transformers saves them
    # transformers 5.19 saves the tower and projector under the checkpoints' names and some under its own too
    # (`model.`): the checkpoints' are kept.
    weights = {k: v for k, v in load_file(folder / "model.safetensors").items()
               if k.startswith(("vision_tower.", "mm_projector."))}
    assert any(k.startswith("vision_tower.") for k in weights) and "mm_projector.proj.0.weight" in weights
    weights.update({f"language_model.{k}": v for k, v in load_file(text_folder / "model.safetensors").items()})
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["KimiK25ForConditionalGeneration"]  # the checkpoints' (and vLLM's registry's) name
    (folder / "config.json").write_text(json.dumps(raw))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (text_folder / name).exists():
            (folder / name).write_bytes((text_folder / name).read_bytes())
    return folder


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    return build_kimi_k25(tmp_path_factory.mktemp("kimi") / "kimi_k25")


@pytest.fixture(scope="module")
def reference(kimi_path):
    model = load_model(str(kimi_path), backend="eager", attn_implementation="eager", device="cpu")
    model.runtime.load()
    return model


@requires("vllm")
@requires("slow")  # an engine start each: about 45 s here (vllm-static's compile and two ranks, about 90 s)
@pytest.mark.parametrize("backend, num_gpus", [("vllm", 1), ("vllm-static", 1), ("vllm", 2)])
def test_every_served_point_plain_and_under_writes_equals_eager_reading_the_wrapper(kimi_path, reference, backend,
                                                                                    num_gpus):
    """DeepSeek's every served point at every layer, plain and under its writes (router steering included); at
    num_gpus=2 the wrapper's text model split over two ranks."""
    assert reference.arch.family == "deepseek_v3"
    for model in _served(kimi_path, num_gpus, backend, reference):
        check_every_point_and_write_equals_eager(model, reference)


@requires("vllm")
def test_the_wrapper_loads_on_both_vllm_backends_as_deepseek_before_any_engine_starts(kimi_path, reference):
    """No refusal for the wrapper (the engine starts lazily, at the first call: nothing starts here); the points
    vllm serves are DeepSeek's there, and vllm-static takes DeepSeek's declarations."""
    from tests.test_deepseek_vllm import SERVED, WRITES

    model = load_model(str(kimi_path), backend="vllm", max_model_len=128)
    assert model.arch.family == "deepseek_v3" and model.cfg == reference.cfg
    assert {a.point for a in model.points()} == SERVED
    static = load_model(str(kimi_path), backend="vllm-static", max_model_len=128, static_points=["kv_latent.1"],
                        static_writes=WRITES)
    assert static.arch.family == "deepseek_v3"
