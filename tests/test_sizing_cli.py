"""The sizer's CLI (`interp-engine size`), its bad inputs refused with the fix (knobs, config files, repo ids without
a download), and its GPU table."""

import json

import pytest

from interp_engine.cli import main
from interp_engine.errors import BackendError, LoadError, PointError, SpecError
from interp_engine.sizing import GPUS_MIB, OVERHEAD_BYTES, estimate, estimate_from_config
from tests.sizing_configs import GiB, LLAMA_8B, LLAMA_70B, QWEN3_32B, write_config

pytestmark = pytest.mark.usefixtures("no_network")  # conftest: the sizer reads config.json and nothing else


# ----------------------------------------------------------------------------------------------- CLI

def test_cli_prints_the_report(tmp_path, capsys):
    folder = write_config(tmp_path, LLAMA_70B)
    code = main(["size", str(folder), "--backend", "vllm", "--quantization", "fp8", "--kv-cache-dtype", "fp8",
                 "--num-gpus", "2", "--gpu", "H100-80GB"])
    out = capsys.readouterr().out
    assert code == 0 and "fits: yes" in out and "70.55 B parameters" in out
    assert f'load_model("{folder}", backend="vllm", quantization="fp8", kv_cache_dtype="fp8", num_gpus=2)' in out


def test_cli_static_points_and_a_misfit(tmp_path, capsys):
    folder = write_config(tmp_path, QWEN3_32B)
    assert main(["size", str(folder), "--backend", "vllm-static", "--static-points", "resid_post.3, mlp_out.4",
                 "--max-model-len", "8192", "--concurrency", "2", "--gpu-memory-utilization", "0.8",
                 "--gpu", "H200-141GB"]) == 0
    out = capsys.readouterr().out
    assert "static_points=[\"resid_post.3\", \"mlp_out.4\"]" in out and "gpu_memory_utilization=0.8" in out
    assert main(["size", str(folder), "--backend", "vllm-static", "--static-points", "auto", "--static-writes",
                 "resid_post.3", "--gpu", "H200-141GB"]) == 0
    out = capsys.readouterr().out
    assert 'static_points="auto", static_writes=["resid_post.3"]' in out
    assert "64 points + 1 writes x 2 buffers (mul, add)" in out
    assert main(["size", str(folder), "--gpu", "a100-40gb"]) == 1  # names match case-insensitively
    assert "fits: NO" in capsys.readouterr().out


def test_cli_bad_input_exits_2_with_the_fix(tmp_path, capsys):
    assert main(["size", str(write_config(tmp_path, LLAMA_8B)), "--gpu", "H100"]) == 2
    err = capsys.readouterr().err
    assert "'H100-80GB'" in err and "Fix:" in err and "A40-48GB" in err


# ---------------------------------------------------------------------------------------- bad inputs

@pytest.mark.parametrize(("knobs", "error", "words"), [
    ({"quantization": "fp4"}, SpecError, ["'fp8'", "Schemes"]),
    ({"quantization": "fp8", "backend": "eager"}, BackendError, ["vLLM backend", "FP8"]),
    ({"quantization": "bnb-4bit", "backend": "vllm", "dtype": "float32"}, SpecError, ["16 bits", "bfloat16"]),
    ({"quantization": "bnb-8bit", "backend": "vllm-static"}, BackendError, ["eager"]),
    ({"kv_cache_dtype": "fp9"}, SpecError, ["'fp8'", "KV cache dtypes"]),
    ({"kv_cache_dtype": "fp8", "backend": "eager"}, BackendError, ["vLLM setting"]),
    ({"num_gpus": 0}, SpecError, ["num_gpus=0", "at least 1"]),
    ({"num_gpus": 3}, SpecError, ["tensor parallelism", "[1, 2, 4, 8, 16, 32]"]),
    ({"concurrency": 0}, SpecError, ["concurrency=0"]),
    ({"gpu_memory_utilization": 0}, SpecError, ["(0, 1]"]),
    ({"gpu_memory_utilization": -0.5}, SpecError, ["(0, 1]"]),
    ({"gpu_memory_utilization": 1.2}, SpecError, ["(0, 1]"]),
    ({"max_model_len": 131_073}, SpecError, ["limit of 131072", "max_model_len=131072"]),
    ({"max_model_len": 0}, SpecError, ["max_model_len=0"]),
    ({"gpu": "H100"}, SpecError, ["'H100-80GB'", "RTX4090-24GB"]),
    ({"gpu": "B300"}, SpecError, ["Known GPUs"]),
    ({"backend": "auto"}, BackendError, ["name the backend"]),
    ({"backend": "vlm"}, BackendError, ["'vllm'"]),
    ({"static_points": "auto"}, BackendError, ["vllm-static"]),
    ({"static_writes": ["resid_post.3"]}, BackendError, ["static_writes=", "vllm-static"]),
    ({"backend": "eager", "static_writes": "auto"}, BackendError, ["static_writes=", "vllm-static"]),
    ({"backend": "vllm-static", "static_writes": ["logits"]}, SpecError, ["only on the eager backend"]),
    ({"backend": "vllm-static", "static_writes": ["resid_post.32"]}, PointError, ["0..31"]),
    ({"backend": "vllm-static", "static_points": "resid_post.3"}, SpecError, ["static_points=[\"resid_post.10\"]"]),
    ({"backend": "vllm-static", "static_points": ["resid_pst.3"]}, PointError, ["'resid_post'"]),
    ({"backend": "vllm-static", "static_points": ["resid_post.32"]}, PointError, ["0..31"]),
    ({"dtype": "bf61"}, SpecError, ["dtype="]),
])
def test_bad_knobs_are_refused_with_the_fix(knobs, error, words):
    with pytest.raises(error) as caught:
        estimate_from_config(LLAMA_8B, repo_id="meta-llama/Llama-3.1-8B", **knobs)
    assert "Fix:" in str(caught.value)
    for word in words:
        assert word in str(caught.value)


def test_a_folder_without_config_json_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        estimate(tmp_path / "empty")


def test_an_unreadable_config_json_is_refused(tmp_path):
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LoadError, match="cannot be read as JSON"):
        estimate(folder)
    (folder / "config.json").write_text(json.dumps({**LLAMA_8B, "hidden_size": "big"}))
    with pytest.raises(LoadError, match="not a valid llama config"):
        estimate(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(TypeError, match="config.json dict"):
        estimate(folder)


def test_an_uncovered_architecture_is_refused(tmp_path):
    with pytest.raises(LoadError, match="covered family"):
        estimate(write_config(tmp_path, {"model_type": "mamba", "hidden_size": 8}))


def test_a_repo_id_neither_local_nor_cached_is_refused_without_download(tmp_path, monkeypatch, offline_hub):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LoadError) as caught:
        estimate("meta-llama/Llama-3.1-8B")
    message = str(caught.value)
    assert "no download was attempted" in message and "local folder" in message and "config.json" in message
    with pytest.raises(LoadError, match="no download"):
        estimate("./not/a/folder/config.json")


def test_a_repo_id_in_the_local_cache_is_read_from_there(tmp_path, monkeypatch, offline_hub):
    hub = offline_hub
    snapshot = hub / "models--meta-llama--Llama-3.1-8B" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(LLAMA_8B))
    (hub / "models--meta-llama--Llama-3.1-8B" / "refs").mkdir()
    (hub / "models--meta-llama--Llama-3.1-8B" / "refs" / "main").write_text("a" * 40)
    monkeypatch.chdir(tmp_path)
    result = estimate("meta-llama/Llama-3.1-8B", max_model_len=8192)
    assert result.params == 8_030_261_248
    assert 'load_model("meta-llama/Llama-3.1-8B", backend="vllm", max_model_len=8192)' in result.snippet


def test_gpu_table_names_the_cards_the_issue_lists():
    for name in ("H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "A40-48GB", "L40S-48GB", "RTX4090-24GB"):
        assert name in GPUS_MIB
    assert OVERHEAD_BYTES == 2 * GiB
