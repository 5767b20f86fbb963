"""backend="vllm" against the eager backend on the same prompts: every point, every op, per-request rows."""

import asyncio
import glob
import os

import pytest
import torch

from interp_engine import BackendError, capture, generate, load_model, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from interp_engine.backends.vllm import sae_refs, wire
from interp_engine.errors import SpecError
from tests.conftest import (PROMPTS, check_each_request_gets_its_own_vector,
                            check_no_steered_kv_reaches_a_plain_call, no_child_survives, random_sae)
from tests.skips import requires

pytestmark = requires("vllm")
RTOL, ATOL = 1e-4, 1e-5
ENVIRON: dict[str, tuple[dict, dict]] = {}  # per family: the driver's os.environ before and after the engine start


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma2"])
def served(request, tiny_path):
    """A live vLLM handle per family; shut down at the end, after which no child process may remain."""
    with no_child_survives():
        model = load_model(str(tiny_path(request.param)), backend="vllm")
        before = dict(os.environ)
        asyncio.run(model.warmup())
        ENVIRON[request.param] = before, dict(os.environ)
        yield request.param, model
        asyncio.run(model.shutdown())
    assert not glob.glob(wire.result_path("arena-*")), "the result arena's file outlived its engine"


@pytest.fixture(autouse=True)
def no_worker_tables_survive(request):
    yield
    if "served" in request.fixturenames:
        _, model = request.getfixturevalue("served")
        if model.is_loaded:
            assert model.runtime.worker_status() == [{"calls": 0, "hooks": 0}]
        assert not model.runtime._slots, "a call ended (or failed) still holding its arena slot"


def test_the_engine_start_leaves_the_driver_environment_as_it_was(served):
    """The variables interp_engine sets for an engine's start (the V1 runner, vllm-static's AOT switch, CPU
    thread binding, the ZMQ socket folder) are the engine's processes' only: the driver's are as before the
    start. (vLLM's own start exports variables of its own; those are not ours to restore. The engine's
    processes rename themselves, which hides their environment from /proc, so that the workers see
    VLLM_USE_V2_MODEL_RUNNER=0 was checked by hand through collective_rpc, which needs insecure serialization.)"""
    family, model = served
    before, after = ENVIRON[family]
    ours = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_AOT_COMPILE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_RPC_BASE_PATH")
    assert {k: after.get(k) for k in ours} == {k: before.get(k) for k in ours}
    assert {k: os.environ.get(k) for k in ours} == {k: before.get(k) for k in ours}
    assert model.is_loaded


def _close(a, b, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), f"{what}: max abs error {(a - b).abs().max().item()}"


def test_weights_equal_eager_and_are_fetched_once(served, eager):
    from tests.test_tl_weights import assert_same_weights

    family, model = served
    assert_same_weights(model.weights, eager(family).weights)
    assert model.weights is model.weights, "fetched from the workers once per engine"


def test_every_point_equals_eager_on_a_ragged_batch(served, eager):
    family, model = served
    reference = eager(family)
    points = model.points()
    assert {"attn_scores", "attn_probs"} <= {a.point for a in points}
    ours, theirs = capture(model, PROMPTS, points), capture(reference, PROMPTS, points)
    assert ours.lengths == theirs.lengths
    for address in points:
        _close(ours[address], theirs[address])


def test_results_come_through_the_arena_and_a_held_result_is_never_overwritten(served, eager):
    """Results are views of the engine's arena (arena.py), handed over: a result still held keeps its pages
    through later calls (it stays equal to eager's), and a dropped one's pages serve the next call."""
    family, model = served
    reference, points = eager(family), ["resid_post.1", "mlp_out.0"]
    # One prompt a call: its rows are handed over as they are (a ragged batch's are padded, a copy, and its slot
    # is free again at once).
    capture(model, PROMPTS[:1], points)  # a first call of its kind: now its size is known
    whole = torch.frombuffer(model.runtime._life.arena._map, dtype=torch.uint8)
    inside = lambda t: whole.data_ptr() <= t.untyped_storage().data_ptr() < whole.data_ptr() + len(whole)
    held = capture(model, PROMPTS[:1], points)
    assert inside(held["resid_post.1"])
    dropped = capture(model, PROMPTS[1:2], points)
    where = dropped["resid_post.1"].untyped_storage().data_ptr()
    del dropped
    again = capture(model, PROMPTS[2:], points)
    assert again["resid_post.1"].untyped_storage().data_ptr() == where  # the dropped call's pages, reused
    theirs = capture(reference, PROMPTS[:1], points)
    for address in points:
        _close(held[address], theirs[address])


@pytest.mark.parametrize("make", [
    lambda d: S.Add("resid_post.1", torch.linspace(-1, 1, d), scale=3.0),
    lambda d: S.Set("resid_mid.2", torch.linspace(0, 1, d), positions="last"),
    lambda d: S.Ablate("z.0", heads=[1, 2]),
    lambda d: S.Scale("k.1", 0.25, heads=[0]) + S.Scale("q.2", 2.0),
    lambda d: S.Ablate("mlp_act.0", heads=None) + S.Add("embed", torch.ones(d), positions=[1, -1]),
    lambda d: S.Add("attn_out.1", torch.ones(d)) + S.Ablate("mlp_out.2") + S.Add("resid_pre.1", torch.ones(d)),
    # A zeroed stream must stay exactly zero through the next norm (RMSNorm scales rounding error up ~1000x).
    lambda d: S.Ablate("resid_mid.1"),
], ids=["add", "set-last", "ablate-heads", "scale-qk", "zero-and-embed", "outs-and-pre", "zero-resid-mid"])
def test_steering_equals_eager(served, eager, make):
    family, model = served
    reference = eager(family)
    spec = make(model.d_model)
    logits = steer(model, PROMPTS, spec)
    _close(logits, steer(reference, PROMPTS, spec))
    assert (logits - steer(model, PROMPTS, S.Spec())).abs().max() > 1e-3, "the edit must change the output"


def test_logits_at_chosen_positions_equal_eager(served, eager):
    family, model = served
    texts = [PROMPTS[0], "Paris", PROMPTS[2]]
    spec = S.Add("resid_post.0", torch.ones(model.d_model))
    kept = steer(model, texts, spec, positions=[-1, 0])
    full = steer(model, texts, spec)
    assert kept.shape == (3, 2, model.d_vocab)
    for b, n in enumerate(len(model.tokenize(t)) for t in texts):
        assert torch.equal(kept[b], full[b, [n - 1, 0]])
    _close(kept, steer(eager(family), texts, spec, positions=[-1, 0]))


def test_logit_lens_runs_in_the_worker_and_equals_eager(served, eager):
    family, model = served
    spec = S.Add("resid_post.0", torch.ones(model.d_model))
    points = ["embed", "resid_mid.1", "resid_post.1", "resid_post.2"]
    ours = logit_lens(model, PROMPTS, points=points, spec=spec)
    _close(ours, logit_lens(eager(family), PROMPTS, points=points, spec=spec))
    last = torch.log_softmax(steer(model, PROMPTS, spec), -1)
    for i, prompt in enumerate(PROMPTS):
        n = len(model.tokenize(prompt))
        _close(ours[-1, i, :n], last[i, :n])


def test_each_request_gets_its_own_vector(served, eager):
    """16 requests in one engine batch, each steered with its own vector, each equal to its solo run."""
    family, model = served
    check_each_request_gets_its_own_vector(model, eager(family), _close)


def test_prefix_cache_never_skips_captured_positions(served, eager):
    family, model = served
    first = capture(model, PROMPTS, ["resid_post.0"])["resid_post.0"]
    again = capture(model, PROMPTS, ["resid_post.0"])["resid_post.0"]  # same prefixes: the cache holds them
    assert torch.equal(first, again)
    _close(again, capture(eager(family), PROMPTS, ["resid_post.0"])["resid_post.0"])


def test_refusals_name_the_fix(served, tiny_path):
    _, model = served
    v = torch.ones(model.d_model)
    cases = [
        (lambda: run_with_grad(model, PROMPTS, loss=lambda x: x.sum(), wrt=["resid_post.0"]), 'backend="eager"'),
        (lambda: steer(model, PROMPTS, S.Custom("resid_post.0", lambda x: x)), 'backend="eager"'),
        (lambda: steer(model, PROMPTS, S.Set("logits", torch.zeros(model.d_vocab))), 'backend="eager"'),
        (lambda: steer(model, PROMPTS, S.Scale("attn_probs.0", 0.5)), 'backend="eager"'),
        (lambda: steer(model, PROMPTS, S.Ablate("z.0", how="mean")), "S.Set("),
        (lambda: load_model(str(tiny_path("qwen2")), backend="vllm").runtime.load(), "shutdown()"),
        (lambda: load_model(str(tiny_path("llama")), backend="vllm", requires_grad=True), "requires_grad=True"),
        (lambda: load_model(str(tiny_path("llama")), backend="vllm", enable_prefix_caching=False),
         "extra_vllm_kwargs"),
    ]
    for call, fragment in cases:
        with pytest.raises(BackendError if fragment != "extra_vllm_kwargs" else ValueError) as info:
            call()
        assert fragment in str(info.value) and "Fix:" in str(info.value), str(info.value)
    assert steer(model, PROMPTS[0], S.Add("resid_post.0", v)).shape[0] == 1, "the handle still works"


def test_steered_generation_equals_eager(served, eager):
    family, model = served
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(3))
    spec = S.Add("resid_post.1", vector, scale=4.0) + S.Scale("v.0", 0.5, heads=[1])
    ours = generate(model, PROMPTS, spec, max_new_tokens=6, stop_at_eos=False)
    theirs = generate(eager(family), PROMPTS, spec, max_new_tokens=6, stop_at_eos=False)
    assert ours.tokens == theirs.tokens
    assert ours.tokens != generate(model, PROMPTS, max_new_tokens=6, stop_at_eos=False).tokens


def test_generated_positions_capture_equals_eager(served, eager):
    family, model = served
    spec = S.Add("resid_post.0", torch.ones(model.d_model), positions="last")
    points = ["resid_post.2", "k.1", "mlp_act.0", "z.2"]
    ours = generate(model, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    theirs = generate(eager(family), PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    assert ours.tokens == theirs.tokens and ours.cache.lengths == theirs.cache.lengths == (4, 4, 4)
    for address in points:
        _close(ours.cache[address], theirs.cache[address])


def test_a_steered_call_never_hands_its_kv_to_a_later_plain_call(served, eager):
    """Every request of a call with a table is salted in vLLM's prefix cache (found: without the salt, a plain
    generation after a steered one on the same prompt read the steered KV and gave other tokens)."""
    family, model = served
    check_no_steered_kv_reaches_a_plain_call(model, eager(family))


def test_sae_features_clamp_and_splice_equal_eager(served, eager):
    family, model = served
    reference = eager(family)
    d = reference.d_model
    saes = (random_sae(d, 0, 1, activation="topk", k=16), random_sae(d, 1, 2, apply_b_dec_to_input=True,
                                                        normalize="constant_norm_rescale"))
    top = saes[1].top_features(6)
    points = [s.features for s in saes] + ["resid_post.1", top]
    ours, theirs = (capture(m, PROMPTS, points, progress=False) for m in (model, reference))
    assert list(ours) == list(theirs)
    for key in theirs:
        if key != top:
            _close(ours[key], theirs[key], str(key))
    dense = theirs[saes[1].features].topk(6, dim=-1)  # the reference: torch.topk of eager's dense read
    _close(ours[top].values, dense.values, str(top))
    fired = dense.values > 0  # a zero's index is torch.topk's pick among features that did not fire
    assert fired.sum() > 10 and torch.equal(ours[top].indices[fired], dense.indices[fired])
    plain = steer(reference, PROMPTS, [], progress=False)
    for spec in (S.Clamp(saes[0], [5, 9], to=30.0) + S.Clamp(saes[1], [2], to=0.0, positions=[-1]),
                 S.Splice(saes[1]), S.Splice(saes[0], error=True) + S.Clamp(saes[1], [0], to=12.0)):
        expected = steer(reference, PROMPTS, spec, progress=False)
        assert not torch.allclose(expected, plain, atol=1e-3), f"{spec}: the edit must change the logits"
        _close(steer(model, PROMPTS, spec, progress=False), expected, str(spec))
    # Each SAE crossed to the workers once (the workers' own count), and the tables named it by reference.
    [held] = model.runtime.worker_saes()
    assert held["saes"] == sorted(sae_refs.key(s) for s in saes) and held["puts"] == 2
    spec = S.Spec((S.Clamp(saes[0], [1], to=2.0),))
    sent = []
    table = model.runtime._life.saes.put("call", spec, spec.to_dict(), (), lambda *a: sent.append(a))
    assert sent == [] and table["ops"][0]["sae"] == {"ref": sae_refs.key(saes[0])}


def test_workers_evict_the_least_recently_used_sae_past_the_bound(served, eager, monkeypatch):
    """A bound of two SAEs (INTERP_ENGINE_SAE_BYTES): three in turn, then the first again, evicted meanwhile and
    put again without the caller's doing; each steered result equals eager's, and the workers (their own record)
    never hold more than the bound. A call whose SAE alone is over the bound is refused before anything is sent."""
    family, model = served
    reference = eager(family)
    saes = [random_sae(reference.d_model, 1, 30 + i) for i in range(3)]
    limit = 2 * sae_refs.size(saes[0])
    monkeypatch.setenv(sae_refs.BOUND_ENV, str(limit))
    [before] = model.runtime.worker_saes()
    plain = steer(reference, PROMPTS, [], progress=False)
    for i, sae in enumerate([*saes, saes[0]]):
        spec = S.Clamp(sae, [3, 7], to=20.0)
        expected = steer(reference, PROMPTS, spec, progress=False)
        assert not torch.allclose(expected, plain, atol=1e-3), "the clamp must change the logits"
        _close(steer(model, PROMPTS, spec, progress=False), expected, f"SAE {i}")
        [held] = model.runtime.worker_saes()
        assert held["bytes"] <= limit and sae_refs.key(sae) in held["saes"], (i, held)
    assert held["saes"] == sorted(sae_refs.key(s) for s in (saes[2], saes[0]))
    assert held["puts"] - before["puts"] == 4, "the first SAE was evicted by the third and put again"
    monkeypatch.setenv(sae_refs.BOUND_ENV, str(limit // 4))
    with pytest.raises(SpecError, match=f"(?s)take {limit // 2} bytes.*Fix: set {sae_refs.BOUND_ENV}"):
        steer(model, PROMPTS, S.Clamp(random_sae(reference.d_model, 1, 33), [0], to=1.0), progress=False)
    assert model.runtime.worker_saes() == [held]


@pytest.mark.parametrize("served", ["llama"], indirect=True)  # plain vLLM: nothing of ours differs by family
def test_vllm_generate_is_plain_vllm(served, tiny_path, eager):
    """vllm-generate installs nothing: greedy tokens equal eager's, capture and steering are refused. Last in
    the file: it shuts `served` down (one engine per process), and a later test would start it again."""
    family, model = served
    asyncio.run(model.shutdown())
    plain = load_model(str(tiny_path(family)), backend="vllm-generate", extra_vllm_kwargs={"enforce_eager": True})
    try:
        out = generate(plain, PROMPTS, max_new_tokens=5, stop_at_eos=False)
        assert out.tokens == generate(eager(family), PROMPTS, max_new_tokens=5, stop_at_eos=False).tokens
        for call in (lambda: capture(plain, PROMPTS, ["resid_post.0"]),
                     lambda: generate(plain, PROMPTS, S.Ablate("z.0"), max_new_tokens=2),
                     lambda: generate(plain, PROMPTS, max_new_tokens=2, capture=["resid_post.0"])):
            with pytest.raises(BackendError, match='backend="vllm"'):
                call()
        with pytest.raises(Exception, match="ie_status"):
            plain.runtime.llm.collective_rpc("ie_status")  # no worker extension in this engine
    finally:
        asyncio.run(plain.shutdown())
