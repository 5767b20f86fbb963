"""expert_out on the vLLM backends at num_gpus=2: each rank holds a slice of every expert's intermediate
dimension, so each rank's recomputed expert outputs are partial sums, summed over the ranks in the worker
(backends/vllm/experts.py). At num_gpus=1 it is compared in the families' shared engines (test_vllm_families.py,
test_deepseek_vllm.py, test_vllm_qwen3_next.py); a two-rank engine costs a minute or more to start here, so these
need INTERP_ENGINE_SLOW=1."""

import asyncio

import pytest
import torch

from interp_engine import capture, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm.runtime import _LIVE
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

pytestmark = [requires("vllm"), requires("slow")]
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("backend", ["vllm", "vllm-static"])
def test_two_ranks_sum_each_experts_partial_outputs_to_eager(tiny_path, eager, backend):
    """Without the sum over ranks each rank's share is a different partial output (its slice of the
    intermediate dimension): eager's expert_out is their sum, plain, under a router write and a stream write."""
    family = "qwen3_moe"
    reference = eager(family)
    points = [a for a in reference.points() if a.point == "expert_out"]
    edits = {"plain": S.Spec(), "router": S.Scale("router_logits.1", -1.0),
             "stream": S.Add("resid_pre.1", torch.linspace(-2, 2, reference.d_model))}
    extra = dict(static_points=points, static_writes=["router_logits.1", "resid_pre.1"]) \
        if backend == "vllm-static" else {}
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path(family)), backend=backend, num_gpus=2, **extra)
        try:
            asyncio.run(model.warmup())
            ours = {name: capture(model, PROMPTS, points, spec) for name, spec in edits.items()}
        finally:
            asyncio.run(model.shutdown())
    for name, spec in edits.items():
        theirs = capture(reference, PROMPTS, points, spec)
        for address in points:
            a, b = ours[name][address], theirs[address]
            atol = ATOL * max(1.0, b.abs().max().item()) if backend == "vllm-static" else ATOL
            assert torch.allclose(a, b, rtol=RTOL, atol=atol), \
                f"{address} {name} at num_gpus=2: max abs error {(a - b).abs().max().item():.2e}"
