"""Concurrency on one vLLM handle: 64 calls in flight at once (asyncio and threads), each with its own spec, each
equal to its solo run; sync functions called from inside a running event loop (a notebook cell)."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from interp_engine import capture, generate, steer
from interp_engine import spec as S
from tests.conftest import PROMPTS, random_sae
from tests.skips import requires

pytestmark = requires("vllm")
N = 64


@pytest.fixture(scope="module")
def served(served_llama):
    return served_llama


def _call(model, i: int):
    """Call i: steer or capture, each with its own vector, scale, layer and positions."""
    v = torch.randn(model.d_model, generator=torch.Generator().manual_seed(i))
    spec = S.Add(f"resid_post.{i % 3}", v, scale=1.0 + i / 8, positions="all" if i % 2 else [0, -1])
    if i % 4 == 3:
        spec = spec + S.Ablate("z.1", heads=[i % 4])
        return lambda: capture(model, PROMPTS, ["resid_post.2", "k.1"], spec, progress=False)
    return lambda: steer(model, PROMPTS, spec, progress=False)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def solo(served):
    return [_call(served, i)() for i in range(N)]


def test_64_concurrent_async_calls_each_equal_their_solo_run(served, solo):
    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=N))  # all 64 in flight, not 6
        return await asyncio.gather(*(asyncio.to_thread(_call(served, i)) for i in range(N)))

    started = time.perf_counter()
    together = asyncio.run(main())
    print(f"\n[concurrency] {N} async calls in {time.perf_counter() - started:.1f} s")
    assert [i for i in range(N) if not _equal(together[i], solo[i])] == []
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_64_calls_from_16_threads_each_equal_their_solo_run(served, solo):
    calls = [_call(served, i) for i in reversed(range(N))]  # another order than the solo runs
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(reversed(list(pool.map(lambda call: call(), calls))))
    assert [i for i in range(N) if not _equal(together[i], solo[i])] == []
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_sync_functions_work_inside_a_running_event_loop(served, solo, eager):
    async def notebook_cell():
        await served.warmup()  # already loaded: returns at once
        out = generate(served, PROMPTS, max_new_tokens=2, stop_at_eos=False, progress=False)
        return _call(served, 0)(), out, capture(eager("llama"), PROMPTS, ["resid_post.0"])

    logits, out, cache = asyncio.run(notebook_cell())
    assert torch.equal(logits, solo[0])
    assert [len(t) for t in out.tokens] == [2, 2, 2]
    assert cache["resid_post.0"].shape[0] == len(PROMPTS)


def test_16_calls_with_16_clamps_each_equal_their_solo_run(served, eager):
    reference = eager("llama")
    saes = [random_sae(reference.d_model, layer, 10 + layer) for layer in (0, 2)]

    def spec(i: int):
        return S.Clamp(saes[i % 2], [i, 20 + i], to=5.0 + 3 * i)

    prompts = [PROMPTS[i % 3] + " " + str(i) for i in range(16)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(lambda i: steer(served, prompts[i], spec(i), progress=False), range(16)))
    for i in range(16):
        solo = steer(reference, prompts[i], spec(i), progress=False)
        assert torch.allclose(together[i], solo, rtol=1e-4, atol=1e-4), f"call {i}"
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_16_concurrent_generations_each_equal_their_solo_run_and_leave_no_table(served):
    """Offline generations keep their tables until collected (the table rides only in a call's first request):
    the workers' own drop at a request's end is for the server's steering jobs only. 16 steered generations of
    all 3 prompts at once, from threads, each equal to its run alone; no table left afterwards."""
    specs = [S.Add(f"resid_post.{i % 3}", torch.randn(served.d_model, generator=torch.Generator().manual_seed(100 + i))
                   * 4) for i in range(16)]

    def run(spec):
        return generate(served, PROMPTS, spec, max_new_tokens=5, stop_at_eos=False, progress=False).tokens

    solo = [run(spec) for spec in specs]
    with ThreadPoolExecutor(max_workers=16) as pool:
        together = list(pool.map(run, specs))
    assert together == solo
    assert len({tuple(map(tuple, t)) for t in solo}) > 4, "the vectors must change the tokens"
    assert served.runtime.worker_status() == [{"calls": 0, "hooks": 0}]
