"""SAEs on vLLM (per request): feature reads, Clamp and Splice equal eager; 16 calls with 16 different clamps (two
SAEs at two layers, mixed in the engine's batches) each equal their solo eager run. vllm-static refuses SAE edits
before loading anything."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from interp_engine import SAE, capture, load_model, steer
from interp_engine import spec as S
from interp_engine.errors import BackendError
from tests.conftest import PROMPTS
from tests.skips import requires

pytestmark = requires("vllm")
RTOL, ATOL = 1e-4, 1e-4


def _sae(d: int, layer: int, seed: int, **kw) -> SAE:
    g = torch.Generator().manual_seed(seed)
    return SAE(torch.randn(d, 4 * d, generator=g) / d ** 0.5, 0.1 * torch.randn(4 * d, generator=g),
               torch.randn(4 * d, d, generator=g) / d ** 0.5, 0.1 * torch.randn(d, generator=g),
               f"resid_post.{layer}", **kw)


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert torch.allclose(a, b, rtol=RTOL, atol=ATOL), f"{what}: max abs error {(a - b).abs().max().item()}"


def test_features_clamp_and_splice_equal_eager(served_llama, eager):
    reference = eager("llama")
    d = reference.d_model
    saes = (_sae(d, 0, 1, activation="topk", k=16), _sae(d, 1, 2, apply_b_dec_to_input=True,
                                                        normalize="constant_norm_rescale"))
    points = [s.features for s in saes] + ["resid_post.1"]
    ours, theirs = (capture(m, PROMPTS, points, progress=False) for m in (served_llama, reference))
    assert list(ours) == list(theirs)
    for key in theirs:
        _close(ours[key], theirs[key], str(key))
    plain = steer(reference, PROMPTS, [], progress=False)
    for spec in (S.Clamp(saes[0], [5, 9], to=30.0) + S.Clamp(saes[1], [2], to=0.0, positions=[-1]),
                 S.Splice(saes[1]), S.Splice(saes[0], error=True) + S.Clamp(saes[1], [0], to=12.0)):
        expected = steer(reference, PROMPTS, spec, progress=False)
        assert not torch.allclose(expected, plain, atol=1e-3), f"{spec}: the edit must change the logits"
        _close(steer(served_llama, PROMPTS, spec, progress=False), expected, str(spec))
    assert served_llama.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_16_calls_with_16_clamps_each_equal_their_solo_run(served_llama, eager):
    reference = eager("llama")
    saes = [_sae(reference.d_model, layer, 10 + layer) for layer in (0, 2)]

    def spec(i: int):
        return S.Clamp(saes[i % 2], [i, 20 + i], to=5.0 + 3 * i)

    prompts = [PROMPTS[i % 3] + " " + str(i) for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda i: steer(served_llama, prompts[i], spec(i), progress=False), range(16)))
    for i in range(16):
        _close(together[i], steer(reference, prompts[i], spec(i), progress=False), f"call {i}")
    assert served_llama.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_vllm_static_refuses_sae_edits_but_reads_features_of_a_declared_point(tiny_path):
    model = load_model(str(tiny_path("llama")), backend="vllm-static", static_points=["resid_post.1"],
                       static_writes=["resid_post.1"])
    sae = _sae(model.d_model, 1, 3)
    with pytest.raises(BackendError, match="(?s)compiled tap.*backend=\"vllm\""):
        steer(model, PROMPTS, S.Clamp(sae, [0], to=1.0), progress=False)
    with pytest.raises(Exception, match="resid_post.0"):
        capture(model, PROMPTS, [_sae(model.d_model, 0, 4).features], progress=False)
    assert not model.runtime.is_loaded, "refusals come before the engine loads"
