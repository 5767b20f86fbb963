"""Tiny multimodal wrapper checkpoints (arch/aliases.WRAPPERS), laid out as the published ones: config.json from
transformers' own wrapper config around a tiny text model of `interp_engine.tiny`, a tiny vision tower (and
projector) beside the text weights, the text model's tokenizer in the folder. The text weights are the text
model's, so a wrapper read as its text model must equal that model exactly (the tests' and validator's check).

- `gemma3` (google/gemma-3-4b-pt, -12b, -27b: the checkpoints Gemma Scope 2's SAEs are trained on): written by
  transformers' Gemma3ForConditionalGeneration, whose save is the Hub's layout (`language_model.model.`, vision
  tower and projector at the root); `layout="model"` renames them as transformers 4.52-4.57 saved them
  (`model.language_model.`, `model.vision_tower.`), the layout of many fine-tunes.
- `gemma4` (Gemma 4's published checkpoints): Gemma4ForConditionalGeneration's save (`model.language_model.`);
  `text="gemma4_moe"` wraps the 26B-A4B layout.
- `kimi_k25` (Kimi-K2.5, K2.6): Kimi_K25Config around the tiny DeepSeek-V3; the checkpoints' names
  (`language_model.`, `vision_tower.`, `mm_projector.`) and architectures, which transformers 5.19 does not
  save as such.
"""

import json
import tempfile
from pathlib import Path
from typing import Any, Mapping

# Wrapper model type -> the tiny text model it wraps by default.
WRAPPED = {"gemma3": "gemma3_text", "gemma4": "gemma4_text", "kimi_k25": "deepseek_v3"}
_TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def build_wrapper(wrapper: str, out_dir: str | Path, *, text: str | None = None, seed: int = 0,
                  overrides: Mapping[str, Any] | None = None, layout: str = "saved") -> Path:
    """Write a tiny `wrapper` checkpoint around `text` (a tiny family; WRAPPED's by default) to `out_dir`: its
    weights as transformers saves them ("saved"), or, for gemma3, transformers 4.52-4.57's names ("model")."""
    from interp_engine.tiny import build_tiny_model

    if wrapper not in WRAPPED:
        raise ValueError(f"no tiny wrapper {wrapper!r}; choose one of {', '.join(WRAPPED)}")
    if layout not in ("saved", "model") or (layout == "model" and wrapper != "gemma3"):
        raise ValueError(f"layout={layout!r}: \"saved\", or \"model\" for gemma3")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = text or WRAPPED[wrapper]
    with tempfile.TemporaryDirectory() as scratch:
        text_folder = build_tiny_model(text, Path(scratch) / "text", seed=seed, overrides=overrides)
        config = json.loads((text_folder / "config.json").read_text())
        {"gemma3": _gemma3, "gemma4": _gemma4, "kimi_k25": _kimi_k25}[wrapper](text_folder, config, out, layout)
        for name in _TOKENIZER:
            if (text_folder / name).exists():
                (out / name).write_bytes((text_folder / name).read_bytes())
    (out / "interp_engine_tiny.json").write_text(json.dumps({"family": wrapper, "text": text, "seed": seed,
                                                            "overrides": dict(overrides or {}), "layout": layout},
                                                           default=str))
    return out


def _with_text_weights(wrapper_model, text_folder: Path, out: Path) -> None:
    """Save `wrapper_model` with the text model's weights in its language model."""
    from transformers import AutoModelForCausalLM

    text_model = AutoModelForCausalLM.from_pretrained(str(text_folder))
    missing = wrapper_model.model.language_model.load_state_dict(text_model.model.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    wrapper_model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    wrapper_model.save_pretrained(str(out))


def _gemma3(text_folder: Path, text: dict, out: Path, layout: str) -> None:
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, dtype="float32")
    torch.manual_seed(0)
    _with_text_weights(Gemma3ForConditionalGeneration(config), text_folder, out)
    if layout == "model":
        _rename(out, {"language_model.model.": "model.language_model.", "vision_tower.": "model.vision_tower.",
                      "multi_modal_projector.": "model.multi_modal_projector."})


def _gemma4(text_folder: Path, text: dict, out: Path, layout: str) -> None:
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)
    config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, dtype="float32")
    torch.manual_seed(0)
    _with_text_weights(Gemma4ForConditionalGeneration(config), text_folder, out)


def _kimi_k25(text_folder: Path, text: dict, out: Path, layout: str) -> None:
    from safetensors.torch import load_file, save_file
    from transformers import Kimi_K25Config
    from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25ForConditionalGeneration

    vision = dict(hidden_size=16, num_attention_heads=2, num_hidden_layers=1, intermediate_size=32, pos_emb_height=4,
                  pos_emb_width=4)
    config = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=vision["hidden_size"],
                            tie_word_embeddings=False)
    Kimi_K25ForConditionalGeneration(config).save_pretrained(str(out))
    # transformers 5.19 saves the tower and projector under the checkpoints' names and some under its own too
    # (`model.`): the checkpoints' are kept, and the text weights written under `language_model.`.
    weights = {k: v for k, v in load_file(out / "model.safetensors").items()
               if k.startswith(("vision_tower.", "mm_projector."))}
    assert any(k.startswith("vision_tower.") for k in weights) and "mm_projector.proj.0.weight" in weights
    weights.update({f"language_model.{k}": v for k, v in load_file(text_folder / "model.safetensors").items()})
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["architectures"] = ["KimiK25ForConditionalGeneration"]  # the checkpoints' (and vLLM's registry's) name
    (out / "config.json").write_text(json.dumps(raw))


def _rename(out: Path, prefixes: dict[str, str]) -> None:
    from safetensors.torch import load_file, save_file

    renamed = {}
    for key, value in load_file(out / "model.safetensors").items():
        old = next((p for p in prefixes if key.startswith(p)), None)
        renamed[prefixes[old] + key[len(old):] if old else key] = value
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
