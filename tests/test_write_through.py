"""Write-through (`backends/vllm/write_through.py`): a prefill call's rows copied straight into their place in its
arena slot as they are recorded. On a live engine whose steps hold at most 16 tokens (so a call spans steps and
a prompt is split between two), results against HF's own outputs for ragged prompts, and the fallback (a slot too
small for the plan) against eager; without an engine, the layout against `results.read` and the refusals."""

import asyncio

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from interp_engine import capture, load_model
from interp_engine.backends.vllm import results, wire, write_through
from tests.conftest import no_child_survives
from tests.skips import requires

ATOL = 1e-4
# Ragged, 25 tokens in all: with 16 tokens a step, the call takes two steps at least and one prompt is split.
IDS = [[5, 17, 3, 99, 42, 7, 8, 61, 2, 11, 30], [4, 9, 13, 21], [6, 1, 77, 19, 23, 31, 45, 50, 12]]


@pytest.fixture(scope="module")
def chunked(tiny_path):
    """The tiny Llama on `vllm`, at most 16 tokens a step."""
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend="vllm", max_model_len=64,
                           extra_vllm_kwargs={"max_num_batched_tokens": 16})
        asyncio.run(model.warmup())
        yield model
        asyncio.run(model.shutdown())


def _header_length(t: torch.Tensor) -> int:
    """The safetensors header length of the slot a result tensor views (its storage starts at that length)."""
    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())
    return int.from_bytes(raw[:8].numpy().tobytes(), "little")


@requires("vllm")
def test_ragged_prompts_over_two_steps_equal_hf_and_an_even_call_is_written_through(chunked, tiny_path):
    model = chunked
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_path("llama")), attn_implementation="eager",
                                               dtype=torch.float32).eval()
    points = [f"resid_post.{i}" for i in range(model.n_layers)] + ["attn_out.0", "attn_probs.1"]
    for _ in range(2):  # the second call's slot is sized from the first's result
        cache = capture(model, IDS, points, progress=False)
    for i, ids in enumerate(IDS):
        n = len(ids)
        with torch.inference_mode():
            out = ref(torch.tensor([ids]), output_hidden_states=True, output_attentions=True)
        for layer in range(model.n_layers - 1):  # HF's last hidden state is after the final norm
            torch.testing.assert_close(cache[f"resid_post.{layer}"][i, :n], out.hidden_states[layer + 1][0],
                                       atol=ATOL, rtol=ATOL)
        torch.testing.assert_close(cache["attn_probs.1"][i, :, :n, :n], out.attentions[1][0], atol=ATOL, rtol=ATOL)
        assert torch.all(cache[f"resid_post.{model.n_layers - 1}"][i, n:] == 0), "padding positions are zeros"
    # Prompts of one length come back as views of the slot: its header is the plan's, padded to its room.
    even = [ids[:4] for ids in IDS] * 3
    for _ in range(2):
        cache = capture(model, even, points[:-1], progress=False)
    keys = len(points) - 1
    assert _header_length(cache["resid_post.0"]) == write_through.ROOM_PER_KEY * (keys + 4)
    plain = capture(model, even, ["attn_out.0"], progress=False)["attn_out.0"]
    torch.testing.assert_close(cache["attn_out.0"], plain, atol=0, rtol=0)


@requires("vllm")
def test_a_slot_too_small_for_the_plan_falls_back_to_the_calls_file(chunked, eager):
    """A kind of call seen for the first time gets the smallest slot: every point of the model does not fit it,
    so part of its rows go as before and the whole result to the call's file; a second call fits."""
    points = [p for p in chunked.points() if p.point != "logits"]
    reference = capture(eager("llama"), IDS, points, progress=False)
    for _ in range(2):
        got = capture(chunked, IDS, points, progress=False)
        for address in points:  # attn_scores' masked entries are -inf in both
            assert torch.allclose(got[address], reference[address], rtol=1e-4, atol=1e-5), address


def _lengths_and_rows(lengths):
    prompts = torch.from_numpy(np.repeat(np.arange(len(lengths)), lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    return prompts, positions


def test_rows_in_any_order_read_back_as_written_and_refusals_write_nothing(tmp_path):
    path = str(tmp_path / "arena")
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    lengths = [5, 3, 7]
    plan = write_through.plan({"lengths": lengths}, (path, 4096, 65536), 2)
    prompts, positions = _lengths_and_rows(lengths)
    values = {"resid_post.0": torch.randn(15, 6), "lens:resid_post.0": torch.randn(15, 6).bfloat16()}
    order = torch.randperm(15, generator=torch.Generator().manual_seed(0))
    for key, value in values.items():
        assert plan.put(key, prompts[:6], positions[:6], value[:6])  # a step: prompt 1 split after its first row
        rest = order[order >= 6]
        assert plan.put(key, prompts[rest], positions[rest], value[rest])
    # A row past its prompt's end, or rows of another width: not this plan's, nothing written.
    assert not plan.put("resid_post.0", torch.tensor([1]), torch.tensor([3]), torch.randn(1, 6))
    assert not plan.put("resid_post.0", prompts[:2], positions[:2], torch.randn(2, 7))
    assert plan.finish()
    whole = results.mapped(path)
    nbytes = int.from_bytes(whole[4096:4104].tobytes(), "little")
    flat = wire.decode(torch.from_numpy(whole[4104:4104 + nbytes].copy()))
    for key, value in values.items():
        assert torch.equal(flat[f"{key}|value"], value) and flat[f"{key}|value"].dtype == value.dtype
        assert torch.equal(flat[f"{key}|prompt"], prompts) and torch.equal(flat[f"{key}|pos"], positions)


def test_a_key_missing_rows_is_not_made_readable_and_its_records_hold_only_its_rows(tmp_path):
    path = str(tmp_path / "arena")
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    plan = write_through.plan({"lengths": [4, 4]}, (path, 0, 65536), 1)
    prompts, positions = _lengths_and_rows([4, 4])
    value = torch.randn(8, 3)
    assert plan.put("resid_post.1", prompts[:5], positions[:5], value[:5])
    assert not plan.finish() and int.from_bytes(results.mapped(path)[:8].tobytes(), "little") == 0
    (p, q, v), = plan.records()["resid_post.1"]
    assert torch.equal(p, prompts[:5]) and torch.equal(q, positions[:5]) and torch.equal(v, value[:5])
    # a slot too small for a key: refused, for the caller to keep its rows as before
    small = write_through.plan({"lengths": [4, 4]}, (path, 0, 2048), 1)
    assert not small.put("resid_post.1", prompts, positions, torch.randn(8, 64))
    assert write_through.plan({"lengths": []}, (path, 0, 2048), 1) is None
    assert write_through.plan({"lengths": [4]}, None, 1) is None
