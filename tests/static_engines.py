"""What the vllm-static tests share: loading an engine (one per process) and comparing compiled outputs to eager's."""

import asyncio

import torch

from interp_engine import load_model
from interp_engine.backends.vllm.runtime import _LIVE

RTOL, ATOL = 1e-4, 1e-5


def close_to(a, b, what=""):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    finite = torch.isfinite(b)
    assert torch.equal(finite, torch.isfinite(a)), f"{what}: masked entries differ"
    # Inductor fuses and reorders reductions (RMSNorm, softcapping): absolute error grows with the magnitude.
    atol = ATOL * max(1.0, b[finite].abs().max().item())
    assert torch.allclose(a[finite], b[finite], rtol=RTOL, atol=atol), \
        f"{what}: max abs error {(a[finite] - b[finite]).abs().max().item()}"


def load_static(path, **kwargs):
    # One engine per process: a module fixture's engine may still be up; it reloads lazily if used again.
    for live in list(_LIVE.values()):
        live.unload()
    model = load_model(str(path), backend="vllm-static", **kwargs)
    asyncio.run(model.warmup())
    return model
