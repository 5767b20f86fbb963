"""What the README says about this build matches the code, and its Python snippets import what they use."""

import re
from pathlib import Path

from interp_engine.arch import vllm_model_types

README = (Path(__file__).parent.parent / "README.md").read_text()
# The names the README gives each model type with a vLLM layout (a new family adds its name here and there).
SHOWN = {"gemma2": "Gemma-2", "gemma3_text": "Gemma 3", "gemma4_text": "Gemma 4", "phi3": "Phi-3", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3",
        "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "gpt_oss": "GPT-OSS", "deepseek_v3": "DeepSeek-V3",
        "qwen3_next": "Qwen3-Next", "qwen3_5_text": "Qwen3.5", "qwen3_5_moe_text": "Qwen3.5-MoE", "olmo2": "OLMo 2",
        "gpt2": "GPT-2", "gpt_neox": "GPT-NeoX", "phi": "Phi"}


def test_the_auto_section_names_every_family_with_a_vllm_layout():
    start = README.index('**`backend="auto"`**')
    section = README[start: README.index("\n\n", start)]
    assert set(vllm_model_types()) <= set(SHOWN), f"name the new family in SHOWN and the README: {vllm_model_types()}"
    for model_type in vllm_model_types():
        assert f"{SHOWN[model_type]}," in section or f"{SHOWN[model_type]}:" in section, (model_type, section)


def test_python_snippets_import_torch_where_they_use_it():
    for block in re.findall(r"```python\n(.*?)```", README, flags=re.S):
        if "torch." in block and not block.lstrip().startswith(">>>"):
            assert re.search(r"^import (\w+, )*torch\b", block, flags=re.M), block


def test_the_family_table_is_the_one_generated_from_the_committed_validator_results():
    from validator.comparison import report

    rows, meta = report.load(report.ROOT / "validator" / "results" / "results.json")
    start, end = README.index(report.START), README.index(report.END) + len(report.END)
    assert README[start:end] == report.readme_section(rows, meta), \
        "Fix: python -m validator.comparison.report --readme (never edit the table by hand)"
