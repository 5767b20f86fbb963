"""How the bad-input tests check a refusal: the library's error, a Fix: line and every fragment, before any forward
pass (counted with a forward pre-hook on eager; the engine's request counter and the workers' tables on vLLM), and
the handle serving the next call."""

import contextlib

import pytest

from interp_engine import capture
from interp_engine.errors import InterpEngineError

PROMPT = "Hello, world! Tell me a story"


def tokens_of(model):
    return model.to_tokens(PROMPT)


@contextlib.contextmanager
def forward_calls(model):
    """Counts forward passes of the HF model; the hook is gone on exit, so the purity check still holds."""
    calls: list[int] = []
    hook = model.runtime.model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        hook.remove()


def assert_still_works(model) -> None:
    tokens = tokens_of(model)
    cache = capture(model, tokens, ["resid_post.0"], progress=False)
    assert cache["resid_post.0"].shape == (1, tokens.shape[1], model.d_model)


def assert_refused(model, call, error: type, *fragments: str) -> str:
    """`call(model)` raises `error` naming the fix and every fragment, with no forward pass; the handle works."""
    with forward_calls(model) as calls, pytest.raises(error) as info:
        call(model)
    message = str(info.value)
    assert isinstance(info.value, InterpEngineError)
    assert "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert not calls, "a forward pass ran before the error"
    assert_still_works(model)
    return message



def engine_state(model) -> tuple[int, list[dict]]:
    """Requests the engine has been given so far, and the tables and hooks installed in its workers."""
    return model.runtime.llm.request_counter.counter, model.runtime.worker_status()



def assert_refused_on_vllm(model, call, error: type, *fragments: str) -> None:
    """`call(model)` raises `error`, a library error whose message has a Fix: line and every fragment, before
    the engine saw any request or kept any table; the handle serves the next call."""
    before = engine_state(model)
    with pytest.raises(error) as info:
        call(model)
    message = str(info.value)
    assert isinstance(info.value, InterpEngineError) and "Fix:" in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in:\n{message}"
    assert engine_state(model) == before, "the engine saw a request or kept a table"
    assert capture(model, PROMPT, ["resid_post.0"], progress=False)["resid_post.0"].shape[-1] == 128
