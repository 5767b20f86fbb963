"""scripts/gpu_check.py is the one prepared check a lent GPU machine runs (no vLLM, no internet, minutes of device
time): kept working where no GPU is by its dry run on the CPU, which runs every per-family check of every tiny
family (capture, steer, run_with_grad, generate, no hook left) in float32 and bfloat16; bnb, device_map, the
num_gpus refusal and speed run on CUDA only."""

import json
import os
import subprocess
import sys
from pathlib import Path

from interp_engine.tiny import FAMILIES

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_script_dry_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    checks = {r["check"] for r in results}
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    for family in FAMILIES:
        for dtype in ("float32", "bfloat16"):
            assert f"{family}/{dtype} capture vs HF hidden states/attentions/logits" in checks
            assert f"{family}/{dtype} no hook left on the model" in checks
        assert f"{family}/float32 run_with_grad vs torch.autograd.grad" in checks
        assert f"{family}/float32 greedy generate == HF generate" in checks
