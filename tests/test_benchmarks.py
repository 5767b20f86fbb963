"""The benchmark driver's quick mode runs every scenario's code path and writes its reports. No timing is
asserted: the numbers are reported, as ratios against a baseline measured in the same run."""

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import report, run_all
from tests.skips import requires

ROOT = Path(__file__).resolve().parents[1]


def _run_all(tmp_path, suites: str) -> dict:
    # The peers' venv is a machine-local extra; CI has none, and the peers suite reports itself not installed.
    cmd = [sys.executable, "-m", "benchmarks.run_all", "--quick", "--suites", suites, "--out", str(tmp_path)]
    env = {**os.environ, "INTERP_ENGINE_BENCH_CACHE": str(tmp_path / "models"),
           "PEERS_PYTHON": str(tmp_path / "no-peers")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads((tmp_path / "results.json").read_text())
    statuses = {(r["suite"], r["path"]): r.get("status") for r in data["rows"] if "ratio" not in r}
    assert not [k for k, s in statuses.items() if s == "error"], statuses
    return data


def _timed(data: dict) -> set[tuple[str, str]]:
    return {(r["suite"], r["path"]) for r in data["rows"] if "ratio" in r}


def test_quick_benchmarks_run_every_scenario_and_write_their_files(tmp_path):
    """Eager, the peers and `vllm` (one engine start). vllm-static and vllm-generate run the same suite_vllm code
    with other load arguments, at a compiled engine start each: the test below, with INTERP_ENGINE_SLOW=1."""
    data = _run_all(tmp_path, "eager,peers,vllm")
    timed = _timed(data)
    for path in ("capture_resid_post", "capture_all_points", "logit_lens", "run_with_grad", "steered_generate"):
        assert ("eager", path) in timed, path
    if data["suites"]["vllm"].get("status") == "ok":
        for path in ("capture_resid_post", "capture_all_points", "logit_lens", "steered_generate"):
            assert ("vllm", path) in timed, path
        statuses = {(r["suite"], r["path"]): r.get("status") for r in data["rows"] if "ratio" not in r}
        assert statuses[("vllm", "run_with_grad")] == "not_served"
    md = (tmp_path / "results.md").read_text()
    assert "| capture resid_post (all layers) | eager |" in md and "parameters" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"
    section = report.readme_section(data)
    assert section.startswith(report.START) and section.endswith(report.END) and "capture every point" in section


@requires("slow")
def test_quick_benchmarks_time_vllm_static_against_the_default_engine(tmp_path):
    data = _run_all(tmp_path, "vllm-static,vllm-generate")
    timed = _timed(data)
    assert ("vllm-generate", "generate") in timed or data["suites"]["vllm-generate"].get("status") != "ok"
    assert data["suites"]["vllm-static"].get("status") in ("ok", "not_built", "not_served")
    if all(data["suites"][s].get("status") == "ok" for s in ("vllm-static", "vllm-generate")):
        # vllm-static's prefill and decode, each over the default engine's (no taps) at the same size
        for path in ("capture_resid_post", "steered_generate"):
            assert ("vllm-static vs plain engine", path) in timed, path


def test_vllm_static_rows_are_divided_by_the_default_engines_plain_paths_at_the_same_size():
    """run_all's merge of two suites' processes (in CI, where the suites that feed it do not run)."""
    static = [{"suite": "vllm-static", "path": "capture_resid_post", "baseline": "plain_prefill", "batch": 2,
               "seq": 16, "path_ms": 30.0, "baseline_ms": 20.0, "ratio": 1.5, "min_ratio": 1.4},
              {"suite": "vllm-static", "path": "steered_generate", "baseline": "plain_decode", "batch": 4, "seq": 16,
               "path_ms": 90.0, "baseline_ms": 80.0, "ratio": 1.125, "min_ratio": 1.1},  # no baseline at 4x16
              {"suite": "vllm", "path": "capture_resid_post", "baseline": "plain_prefill", "batch": 2, "seq": 16,
               "path_ms": 50.0, "baseline_ms": 20.0, "ratio": 2.5, "min_ratio": 2.4}]
    plain = [{"batch": 2, "seq": 16, "plain_prefill": 24.0, "plain_decode": 70.0}]
    [row] = run_all.against_plain_engine(static, plain)
    assert row["suite"] == "vllm-static vs plain engine" and row["path"] == "capture_resid_post"
    assert row["baseline_ms"] == 24.0 and row["ratio"] == 30.0 / 24.0 and row["min_ratio"] is None


def test_separate_runs_merge_into_their_median_and_range_and_a_run_that_missed_is_said():
    """run_all's merge of --runs (separate processes) and the README cell and verdict made of it."""
    def row(ratio: float, batch: int) -> dict:
        return {"suite": "vllm", "scenario": "capture resid_post (all layers)", "path": "capture_resid_post",
                "baseline": "plain_prefill", "batch": batch, "seq": 16, "path_ms": 20.0 * ratio, "baseline_ms": 20.0,
                "ratio": ratio, "min_ratio": 0.5 * ratio}
    refused = {"suite": "vllm", "scenario": "run_with_grad", "path": "run_with_grad", "status": "not_served",
               "note": "vLLM runs no backward pass"}
    merged = run_all.merge_runs([[row(1.02, 2), row(1.00, 4), refused], [row(1.12, 2), row(1.04, 4)],
                                 [row(1.06, 2), row(1.01, 4)]])
    cells = {r["batch"]: r for r in merged if "ratio" in r}
    assert cells[2]["run_ratios"] == [1.02, 1.12, 1.06] and cells[2]["ratio"] == 1.06
    assert cells[2]["path_ms"] == 20.0 * 1.06 and cells[2]["min_ratio"] == 0.5 * 1.02 and refused in merged
    data = {"mode": "full", "machine": "a CPU, 2 cores, no GPU", "num_gpus": 1, "reps": 5, "runs": 3, "new_tokens": 16,
            "when": "now", "seconds": 60.0, "suites": {}, "rows": merged,
            "model": {"model_type": "llama", "n_params": 1e8, "layers": 12, "d_model": 768, "d_mlp": 3072,
                      "vocab": 32000, "dtype": "float32"}}
    section = report.readme_section(data)
    assert "| 1.06 (1.02-1.12) | 1.01 (1.00-1.04) | <= 1.10: met by the median, missed in 1 of 3 runs" in section
    assert "the median over 3 separate runs" in section and "run_with_grad: not_served" in section
    assert "| 1.060 (1.020-1.120) |" in report.markdown(data)
    assert "met in every run" in report.readme_section({**data, "rows": run_all.merge_runs([[row(1.02, 2)]] * 2)})


@requires("vllm")
def test_small_calls_quick_mode_times_capture_against_plain_prefill(tmp_path):
    """On `vllm` only: vllm-static's run differs by its load arguments alone and would cost CI two compiled
    engines (its own and the default engine's); the quick benchmarks above run vllm-static's paths."""
    out = tmp_path / "small_calls.json"
    cmd = [sys.executable, "-m", "benchmarks.small_calls", "--quick", "--backends", "vllm", "--out", str(out)]
    env = {**os.environ, "INTERP_ENGINE_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["backend"], r["path"]) for r in rows} == {
        ("vllm", p) for p in ("capture_one_point", "capture_resid_post_all")}
    for row in rows:
        assert row["calls"] == 10 and row["p50_ms"] > 0 and row["plain_p50_ms"] > 0, row


def test_sae_quick_mode_times_feature_capture_and_clamped_decode_on_eager(tmp_path):
    """benchmarks/sae.py end to end on eager (vllm and vllm-static: one engine start each, run by hand)."""
    out = tmp_path / "sae.json"
    cmd = [sys.executable, "-m", "benchmarks.sae", "--quick", "--runs", "1", "--reps", "1", "--backends", "eager",
           "--out", str(out)]
    env = {**os.environ, "INTERP_ENGINE_BENCH_CACHE": str(tmp_path / "models")}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads(out.read_text())["summary"]
    assert {(s["path"], s["baseline"]) for s in summary} == {
        ("capture_features", "capture_point"), ("capture_top_features", "capture_point"),
        ("clamped_decode", "plain_decode")}
    assert all(s["ratio"] > 0 and s["runs"] == 1 for s in summary)
