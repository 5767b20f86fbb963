"""What keeps small calls on vLLM cheap, on a live engine. A call's requests run in one engine step (`gather.py`, the
engine core's scheduler): held until the call's last one arrives, whatever the race between vLLM's busy loop and
its input thread; a call aborted mid-submit leaves nothing held that could run later; requests that say nothing of
their call pass straight through. A CPU engine's processes start with the allocator settings that keep freed pages
(`allocator.py`), unless the user set their own."""

import uuid

import pytest
import torch

from interp_engine import allocator, capture
from interp_engine.backends.vllm import compat, engine, gather, wire
from tests.conftest import PROMPTS
from tests.skips import requires

pytestmark = requires("vllm")
EIGHT = [f"{p} {i}" for i, p in enumerate(PROMPTS * 3)][:8]


@pytest.fixture
def steps(served_llama, monkeypatch):
    """The request ids each engine step finished, step by step, as the driver receives them."""
    llm_engine = served_llama.runtime.llm.llm_engine
    seen: list[set[str]] = []
    step = llm_engine.step

    def recording():
        outputs = step()
        seen.append({o.request_id for o in outputs if o.finished})
        return outputs

    monkeypatch.setattr(llm_engine, "step", recording)
    return seen


def _request(llm, request_id: str, call: str, of: int) -> None:
    """A plain one-token request of `call` (no table: the workers do nothing with it), saying the call sends `of`."""
    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                            extra_args=wire.tag(call, 0, 3, None, of) if of else None)
    compat.add_request(llm, request_id, tokens_input([1, 2, 3], cache_salt=call), params)


def _settings(runtime) -> tuple[dict, dict]:
    """The engine's start settings, without the socket folder `settings` makes for a start."""
    kwargs, env = engine.settings(runtime)
    engine.remove_sockets(env.get(engine.SOCKETS))
    return kwargs, env


def _step_until(llm, wanted: set[str], steps: list[set[str]]) -> None:
    while not wanted <= set().union(*steps):
        compat.step(llm)


def test_a_calls_eight_prompts_run_in_one_step_and_equal_their_one_prompt_calls(served_llama, steps):
    together = capture(served_llama, EIGHT, ["resid_post.1", "q.0"], progress=False)
    finished = [s for s in steps if s]
    assert len(finished) == 1 and len(finished[0]) == 8, f"finished per step: {[len(s) for s in finished]}"
    alone = [capture(served_llama, [p], ["resid_post.1", "q.0"], progress=False) for p in EIGHT]
    for i, one in enumerate(alone):
        for address, value in one.items():
            n = value.shape[1]
            torch.testing.assert_close(together[address][i, :n], value[0], rtol=1e-5, atol=1e-5)


def test_a_call_is_held_until_its_last_request_while_others_run(served_llama, steps):
    llm, call = served_llama.runtime.llm, uuid.uuid4().hex
    with served_llama.runtime._dispatch.lock:
        _request(llm, "held-0", call, 3)
        _request(llm, "held-1", call, 3)
        _request(llm, "plain", uuid.uuid4().hex, 0)  # sent after them, yet it runs while they are held
        _step_until(llm, {"plain"}, steps)
        assert not {"held-0", "held-1"} & set().union(*steps)
        _request(llm, "held-2", call, 3)
        _step_until(llm, {"held-0", "held-1", "held-2"}, steps)
    assert {"held-0", "held-1", "held-2"} in steps  # all three in one step


def test_an_abort_mid_submit_ends_the_hold_and_the_engine_serves_on(served_llama, steps):
    llm, call = served_llama.runtime.llm, uuid.uuid4().hex
    with served_llama.runtime._dispatch.lock:
        _request(llm, "cut-0", call, 4)
        _request(llm, "cut-1", call, 4)
        compat.abort_requests(llm, ["cut-0", "cut-1"])  # what the dispatcher does on Ctrl-C mid-submit
    out = capture(served_llama, PROMPTS, ["resid_post.0"], progress=False)
    assert out["resid_post.0"].shape[0] == len(PROMPTS)
    assert not {"cut-0", "cut-1"} & set().union(*steps)
    assert not llm.llm_engine.has_unfinished_requests()
    assert served_llama.runtime.worker_status() == [{"calls": 0, "hooks": 0}]


def test_the_engine_gathers_unless_the_user_names_a_scheduler(served_llama):
    runtime = served_llama.runtime
    assert _settings(runtime)[0]["scheduler_cls"] == gather.QUALNAME
    own = "vllm.v1.core.sched.scheduler.Scheduler"
    saved = runtime.engine_kwargs
    try:
        runtime.engine_kwargs = {**saved, "scheduler_cls": own}
        assert _settings(runtime)[0]["scheduler_cls"] == own
    finally:
        runtime.engine_kwargs = saved


def test_a_cpu_engine_starts_keeping_freed_pages_unless_the_user_set_the_allocator(served_llama, monkeypatch):
    # The settings are what the engine's processes start under (`procs.environ` around `LLM()`, as the socket folder
    # is); their /proc environ cannot show it: vLLM's setproctitle writes the process title over that memory.
    for k in allocator.SETTINGS:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    every = {"MALLOC_TRIM_THRESHOLD_": str(4 << 30), "MALLOC_MMAP_THRESHOLD_": str(1 << 30)}
    expected = {} if torch.cuda.is_available() else every  # a CPU engine's only
    assert {k: v for k, v in _settings(served_llama.runtime)[1].items() if k in every} == expected
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    env = _settings(served_llama.runtime)[1]
    assert "MALLOC_TRIM_THRESHOLD_" not in env
    assert env.get("MALLOC_MMAP_THRESHOLD_") == expected.get("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert not {k for k in _settings(served_llama.runtime)[1] if k in every}
