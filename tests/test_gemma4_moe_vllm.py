"""Gemma 4's MoE block (26B-A4B layout, tiny) on the vLLM backends against eager (itself checked against HF's own
router, experts and norms in test_gemma4_moe.py), one engine per backend for the module: every point plain and
under a router steer (vLLM's own Gemma 4 routing function choosing from the edited logits) with writes at the
dense MLP's and the block's points; the experts chosen equal eager's. `vllm` at num_gpus=1 runs in CI;
vllm-static's compile and the two-rank engine run with INTERP_ENGINE_SLOW=1."""

import asyncio

import pytest
import torch

from interp_engine import capture, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm.runtime import _LIVE
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

pytestmark = requires("vllm")
FAMILY = "gemma4_moe"
RTOL, ATOL = 1e-4, 1e-4  # fp32; the bound
WRITES = ("router_logits.0", "router_logits.1", "mlp_act.2", "mlp_out.2", "resid_mid.1")


@pytest.fixture(scope="module", params=["vllm", pytest.param("vllm-static", marks=requires("slow")),
                                        pytest.param("vllm-2", marks=requires("slow"))])
def served(request, tiny_path, eager):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    backend, kwargs = request.param, {}
    if backend == "vllm-static":
        kwargs = dict(static_points=eager(FAMILY).points(), static_writes=WRITES)
    elif backend == "vllm-2":
        backend, kwargs = "vllm", dict(num_gpus=2)
    with no_child_survives():
        model = load_model(str(tiny_path(FAMILY)), backend=backend, **kwargs)
        asyncio.run(model.warmup())
        yield model
        asyncio.run(model.shutdown())


def _close(a, b, what, model):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    # Inductor (vllm-static) fuses and reorders reductions: absolute error grows with the magnitude.
    atol = ATOL * max(1.0, b.abs().max().item()) if model.backend == "vllm-static" else ATOL
    err = (a - b).abs().max().item()
    assert torch.allclose(a, b, rtol=RTOL, atol=atol), f"{what} on {model.backend}: max abs error {err}"


def test_every_point_and_the_chosen_experts_equal_eager_plain_and_under_a_router_steer(served, eager):
    """router_logits.1 + a ramp moves tokens to other experts and router_logits.0 * -1 sends every token to its
    least likely ones, with writes at the dense MLP (mlp_act), the block's output and resid_mid (which the
    router reads): every point and the experts chosen equal eager's, expert_out included (recomputed in the
    worker from pre_feedforward_layernorm_2 of the router's input rows; without that norm it is off by ~4)."""
    model, reference = served, eager(FAMILY)
    points = model.points()
    assert points == reference.points()  # expert_out too: recomputed from pre_feedforward_layernorm_2's rows
    steered = (S.Add("router_logits.1", torch.linspace(-3, 3, 8)) + S.Scale("router_logits.0", -1.0)
               + S.Ablate("mlp_act.2") + S.Add("mlp_out.2", torch.linspace(-1, 1, model.d_model))
               + S.Add("resid_mid.1", torch.linspace(1, -1, model.d_model)))
    for edits in (S.Spec(), steered):
        ours, theirs = capture(model, PROMPTS, points, edits), capture(reference, PROMPTS, points, edits)
        for address in points:
            _close(ours[address], theirs[address], f"{address} {edits!r:.40}", model)
            if address.point == "expert_weights":
                assert torch.equal(ours[address] > 0, theirs[address] > 0), f"{address}: other experts chosen"
    plain = capture(reference, PROMPTS, ["expert_weights.1"])["expert_weights.1"]
    assert ((ours["expert_weights.1"] > 0) != (plain > 0)).any(-1).float().mean() > 0.3, "the steer moved too few"

