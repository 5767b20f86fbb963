"""Issue 19, item 1: one call never takes the engine down for every caller.

Every input that used to pass the checks and then fail inside the forward pass (raw OverflowError, IndexError,
RuntimeError on eager; a dead engine core on vLLM) is now refused before any forward with the library's error and
a Fix: line, on eager, vllm and vllm-static alike. What still fails inside a vLLM worker (forced here with a plan
that skips the driver's checks) fails that call alone, with the library's error: a call sharing its steps and the
calls after it equal their solo runs, the workers keep no table or hook, the engine stays up and, at shutdown,
leaves no process behind.
"""

import asyncio
import json
import os
import threading
import time

import pytest
import torch

from interp_engine import Spec, capture, generate, load_model, steer
from interp_engine import spec as S
from interp_engine.addresses import Address
from interp_engine.backends.vllm.runtime import _LIVE
from interp_engine.errors import InputTypeError, InterpEngineError, SpecError
from interp_engine.inputs import to_prompts
from interp_engine.spec import Positions, TensorData
from interp_engine.validate import Plan
from tests.conftest import no_child_survives, spec_dict
from tests.refusals import assert_refused, assert_refused_on_vllm
from tests.skips import requires

PROMPT, OTHER = "Hello, world! Tell me a story", "Paris is the capital of"
NAN = float("nan")


def _scaled(positions):
    return lambda m: steer(m, PROMPT, S.Scale("resid_post.0", 2.0, positions=positions()), progress=False)


def _added(vector, scale=1.0):
    return lambda m: steer(m, PROMPT, S.Add("resid_post.0", vector(), scale=scale), progress=False)


# (call, error, fragments). Each case passed validation before and failed inside the forward: Positions and
# TensorData built directly skipped the checks `Positions.of` / `TensorData.of` make, and numbers past the model's
# dtype wrote inf (then NaN logits, which vLLM's worker or eager's sampler fail on).
CASES = [
    pytest.param(_scaled(lambda: Positions("slice", stop=2**63)), SpecError,
                 ("position 9223372036854775808 is past any prompt",), id="direct-slice-stop-2**63"),
    pytest.param(_scaled(lambda: Positions("slice", start=1, step=0)), SpecError,
                 ("slice step must be positive, got 0",), id="direct-slice-step-0"),
    pytest.param(_scaled(lambda: Positions("slice", start=1, step=-1)), SpecError,
                 ("slice step must be positive, got -1",), id="direct-slice-step-negative"),
    pytest.param(_scaled(lambda: Positions("slice", start=1.5)), SpecError, ("position 1.5 is not an int",),
                 id="direct-slice-float-start"),
    pytest.param(_scaled(lambda: Positions("indices", indices=(2**63,))), SpecError,
                 ("position 9223372036854775808 is past any prompt",), id="direct-index-2**63"),
    pytest.param(_scaled(lambda: Positions("indices")), SpecError, ("selects nothing",), id="direct-no-indices"),
    pytest.param(_scaled(lambda: Positions("bogus")), SpecError, ("'bogus' is not one of all, last",),
                 id="direct-unknown-kind"),
    pytest.param(_scaled(lambda: Positions("all", indices=(1,))), SpecError, ("also sets indices",),
                 id="direct-all-with-indices"),
    pytest.param(_scaled(lambda: Positions("per_prompt", per_prompt=("last",))), SpecError,
                 ("is not one entry per prompt",), id="direct-per-prompt-strings"),
    pytest.param(_scaled(lambda: Positions("per_prompt", per_prompt=(Positions.of([[0], [1]]),))), SpecError,
                 ("is not one entry per prompt",), id="direct-nested-per-prompt"),
    pytest.param(_added(lambda: TensorData(torch.full((128,), NAN))), SpecError, ("contains NaN or +inf",),
                 id="direct-nan-tensor"),
    pytest.param(_added(lambda: TensorData(torch.ones(128, dtype=torch.long))), SpecError,
                 ("dtype torch.int64; edits need a floating-point tensor",), id="direct-int-tensor"),
    pytest.param(_added(lambda: TensorData(torch.zeros(128).to(torch.float8_e4m3fn))), SpecError,
                 ("float8_e4m3fn (a float without the CPU kernels",), id="direct-float8-tensor"),
    pytest.param(_added(lambda: TensorData(torch.zeros(128, dtype=torch.complex64))), SpecError,
                 ("dtype torch.complex64",), id="direct-complex-tensor"),
    pytest.param(_added(lambda: TensorData("abc")), InputTypeError, ("must be a torch.Tensor, got str",),
                 id="direct-tensor-of-str"),
    pytest.param(lambda m: steer(m, PROMPT, S.Scale("resid_post.0", 1e300), progress=False), SpecError,
                 ("factor 1e+300, past the largest torch.float32",), id="factor-past-dtype"),
    pytest.param(lambda m: steer(m, PROMPT, Spec.from_dict(json.loads(json.dumps(spec_dict(
        op="Scale", point="resid_post.0", factor=1e300)))), progress=False), SpecError,
                 ("factor 1e+300, past the largest torch.float32",), id="factor-past-dtype-json"),
    pytest.param(_added(lambda: torch.ones(128), scale=1e300), SpecError, ("scale * vector reaches 1e+300",),
                 id="add-scale-past-dtype"),
    pytest.param(_added(lambda: torch.full((128,), 3e38), scale=10.0), SpecError, ("scale * vector reaches 3e+39",),
                 id="add-product-past-dtype"),
    pytest.param(lambda m: steer(m, PROMPT, S.Set("resid_post.0", torch.full((128,), 1e39, dtype=torch.float64)),
                                 progress=False), SpecError, ("value reaches 1e+39",), id="set-float64-past-dtype"),
    pytest.param(lambda m: generate(m, PROMPT, S.Scale("resid_post.0", 1e300), max_new_tokens=2, temperature=1.0,
                                    seed=0, progress=False), SpecError, ("factor 1e+300",), id="sampling-past-dtype"),
]


# ------------------------------------------------------------------------------------------------ eager

@pytest.mark.parametrize("call, error, fragments", CASES)
def test_refused_before_forward_on_eager(eager, call, error, fragments):
    assert_refused(eager("llama"), call, error, *fragments)


def _bad_plan() -> Plan:
    """A plan no check made: a vector of half the width, which `validate.plan` refuses. It reaches the ops."""
    return Plan({Address("resid_post", 0): (S.Add("resid_post.0", torch.randn(64)),)}, (Address("resid_post", 2),))


def _prompts(model, text: str):
    return to_prompts(text, tokenize=model.tokenize, d_vocab=model.d_vocab, max_len=model.dims.max_len)


def _library_error(call) -> str:
    with pytest.raises(InterpEngineError) as info:
        call()
    message = str(info.value)
    assert "Fix:" in message, message
    return message


def test_an_op_failing_inside_the_eager_forward_gets_the_library_error(eager):
    """The purity fixture checks that every hook was removed."""
    model = eager("llama")
    solo = capture(model, OTHER, ["resid_post.2"], progress=False)["resid_post.2"]
    message = _library_error(lambda: model.runtime.forward(_prompts(model, PROMPT), _bad_plan(), batch_size=1,
                                                           want_logits=False, progress=False))
    assert "Add at resid_post.0 failed while the forward pass ran (RuntimeError" in message
    assert torch.equal(capture(model, OTHER, ["resid_post.2"], progress=False)["resid_post.2"], solo)


def test_a_custom_function_that_raises_gets_the_library_error(eager):
    message = _library_error(lambda: steer(eager("llama"), PROMPT, S.Custom("resid_post.0", lambda x: 1 / 0),
                                           progress=False))
    assert "Custom fn at resid_post.0 raised ZeroDivisionError" in message


def test_sampling_from_nan_logits_gets_the_library_error(eager):
    message = _library_error(lambda: generate(eager("llama"), PROMPT, S.Custom("resid_post.0", lambda x: x * NAN),
                                              max_new_tokens=2, temperature=1.0, seed=0, progress=False))
    assert "the logits are NaN or infinite" in message


# ------------------------------------------------------------------------------------------------ vLLM

@pytest.fixture(scope="module", params=["vllm", "vllm-static"])
def engine(request, tiny_path):
    """One engine per backend (vLLM holds one per process: any other live one is unloaded first)."""
    for live in list(_LIVE.values()):
        live.unload()
    with no_child_survives():
        model = load_model(str(tiny_path("llama")), backend=request.param, max_model_len=64,
                           **({"static_points": ["resid_post.0", "resid_post.2"], "static_writes": ["resid_post.0"]}
                              if request.param == "vllm-static" else {}))
        asyncio.run(model.warmup())
        yield model
        asyncio.run(model.shutdown())


@requires("vllm")
@pytest.mark.parametrize("call, error, fragments", CASES)
def test_refused_before_any_request_on_vllm(engine, call, error, fragments):
    assert_refused_on_vllm(engine, call, error, *fragments)


@requires("vllm")
def test_a_call_failing_in_the_workers_fails_alone(engine):
    solo = capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"]
    solo_tokens = generate(engine, OTHER, max_new_tokens=4, stop_at_eos=False, progress=False).tokens
    out: dict = {}

    def bad():
        try:
            engine.runtime.forward(_prompts(engine, PROMPT), _bad_plan(), batch_size=1, want_logits=False,
                                   progress=False)
        except BaseException as e:  # noqa: BLE001 - checked below, in the test's thread
            out["bad"] = e

    def good():
        out["good"] = capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"]

    threads = [threading.Thread(target=bad), threading.Thread(target=good)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    error = out.get("bad")
    assert isinstance(error, SpecError) and "Fix:" in str(error), repr(error)
    assert "failed inside the vLLM workers (only it" in str(error)
    assert "Add at resid_post.0 failed while the forward pass ran" in str(error)
    assert torch.equal(out["good"], solo), "a call sharing the engine with the failed one changed"
    # A generation fails the same way, every step; the engine goes on.
    message = _library_error(lambda: engine.runtime.generate(
        _prompts(engine, PROMPT), _bad_plan(), max_new_tokens=3, temperature=0.0, top_k=None, top_p=None, seed=None,
        stop_at_eos=False, batch_size=1, progress=False))
    assert "failed inside the vLLM workers" in message
    assert torch.equal(capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"], solo)
    assert generate(engine, OTHER, max_new_tokens=4, stop_at_eos=False, progress=False).tokens == solo_tokens
    assert engine.runtime.is_alive()
    [status] = engine.runtime.worker_status()
    assert status["calls"] == 0 and status["hooks"] == 0, status
    assert not engine.runtime._slots, "the failed call's arena slot was not given back"


def _served(engine, plan: Plan, *, dropped: bool = False) -> tuple[list[int], "object"]:
    """A server's steering job (a table asking for its failure as it happens, `wire.table(failures=True)`) run on
    this engine, its file made as `serving._tabled` makes it, then answered as `serving._answered` answers it,
    without COLLECT or RELEASE (the workers drop the table themselves): its new tokens and the job. `dropped`: a
    client that hung up mid-step, the job answered (its file deleted) before the worker runs its ops."""
    import uuid

    from vllm import SamplingParams
    from vllm.inputs import tokens_input

    from interp_engine.backends.vllm import serving, wire

    runtime, call, spec = engine.runtime, uuid.uuid4().hex, plan.spec()
    runtime._rpc(wire.ATTACH)  # as the server attaches at start (tests that ran before may not have)
    table = wire.table(call, spec.to_dict(), spec.fingerprint(), [], failures=True)
    job = serving.Job(call, table, serving.Asked(plan))
    wire.make_failure_file(table["path"])
    if dropped:
        serving._answered(serving.Holding(), job)
    ids = list(_prompts(engine, PROMPT).ids[0])
    [out] = runtime._run(call, [tokens_input(ids, cache_salt=call)], [SamplingParams(
        max_tokens=3, temperature=0.0, detokenize=False, ignore_eos=True, skip_reading_prefix_cache=True,
        extra_args=wire.tag(call, 0, len(ids), table))], progress=False)
    if not dropped:
        serving._answered(serving.Holding(), job)
        assert not os.path.exists(wire.result_path(call)), "the server deletes the job's file"
    deadline = time.monotonic() + 30  # the workers drop the table at the scheduler's step after the request's last
    while runtime.worker_status()[0]["calls"] and time.monotonic() < deadline:
        time.sleep(0.05)
    [status] = runtime.worker_status()
    assert status["calls"] == 0 and status["hooks"] == 0, status
    assert not os.path.exists(wire.result_path(call)), "a worker wrote the job's file after the server deleted it"
    return list(out.outputs[0].token_ids), job


@requires("vllm")
def test_a_served_steering_job_failing_in_the_workers_is_answered_with_its_error_without_collect(engine):
    """The server answers a job that only steers as its last request ends (no COLLECT, which waits for the step in
    progress): a worker's failure must be in the job's file by then, and the table leave with the request."""
    plan = Plan(_bad_plan().ops, ())
    _, job = _served(engine, plan)
    assert isinstance(job.error, SpecError) and "Fix:" in str(job.error), repr(job.error)
    assert "failed inside the vLLM workers (only it" in str(job.error)
    assert "Add at resid_post.0 failed while the forward pass ran" in str(job.error)
    good = S.Add("resid_post.0", torch.randn(128, generator=torch.Generator().manual_seed(3)) * 4)
    tokens, job = _served(engine, Plan({good.point: (good,)}, ()))
    assert job.error is None
    steered, plain = (list(generate(engine, PROMPT, spec, max_new_tokens=3, stop_at_eos=False,
                                    progress=False).tokens[0]) for spec in (good, None))
    assert tokens == steered
    assert tokens != plain, "the vector must change the tokens: the test checked nothing"


@requires("vllm")
def test_a_steering_job_dropped_before_its_worker_fails_it_leaves_no_file(engine):
    """A client hangs up while its job's step runs: the server answers the job and deletes its file, then the
    worker fails the call. That order, made certain here: the failure goes nowhere, no file is left in
    /dev/shm (its driver alive, no sweep would take it), and the engine serves on."""
    _, job = _served(engine, Plan(_bad_plan().ops, ()), dropped=True)
    assert job.error is None  # answered before the failure: the client is gone
    assert engine.runtime.is_alive()


@requires("vllm")
@pytest.mark.parametrize("engine", ["vllm-static"], indirect=True)  # only its workers refuse a table
def test_a_table_the_workers_refuse_gets_the_library_error(engine):
    """vllm-static's workers refuse a write at a point not compiled in; the driver's checks are skipped here."""
    solo = capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"]
    plan = Plan({Address("resid_post", 1): (S.Scale("resid_post.1", 2.0),)}, (Address("resid_post", 2),))
    message = _library_error(lambda: engine.runtime.forward(_prompts(engine, PROMPT), plan, batch_size=1,
                                                            want_logits=False, progress=False))
    assert "the vLLM workers refused this call's table" in message and "resid_post.1" in message, message
    _, job = _served(engine, Plan(plan.ops, ()))  # a server's steering job: the refusal is in its file
    assert "the vLLM workers refused this call's table" in str(job.error) and "resid_post.1" in str(job.error)
    assert torch.equal(capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"], solo)
    assert engine.runtime.is_alive() and engine.runtime.worker_status()[0]["calls"] == 0


@requires("vllm")
def test_hook_sets_left_registered_act_only_for_calls_that_need_them(engine):
    """A `vllm` worker keeps a set of points' hooks registered after its calls end, dormant (`hook_sets.py`): a
    later call of the same points without the edits, a plain generation, and the calls after one that failed
    midway see nothing of the steered call, and the workers report no call and no armed hook after each."""
    solo = capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"]
    solo_tokens = generate(engine, OTHER, max_new_tokens=4, stop_at_eos=False, progress=False).tokens
    push = S.Add("resid_post.0", torch.full((engine.d_model,), 3.0))
    steered = capture(engine, OTHER, ["resid_post.2"], push, progress=False)["resid_post.2"]
    assert not torch.allclose(steered, solo)
    # The same set of points (resid_post.0 and .2) armed again, by a call that only reads: no edit of the last.
    assert torch.equal(capture(engine, OTHER, ["resid_post.0", "resid_post.2"], progress=False)["resid_post.2"], solo)
    assert generate(engine, OTHER, max_new_tokens=4, stop_at_eos=False, progress=False).tokens == solo_tokens
    _library_error(lambda: engine.runtime.forward(_prompts(engine, PROMPT), _bad_plan(), batch_size=1,
                                                  want_logits=False, progress=False))
    assert engine.runtime.worker_status() == [{"calls": 0, "hooks": 0}] or engine.backend == "vllm-static"
    assert torch.equal(capture(engine, OTHER, ["resid_post.2"], progress=False)["resid_post.2"], solo)
    assert generate(engine, OTHER, max_new_tokens=4, stop_at_eos=False, progress=False).tokens == solo_tokens
    assert torch.equal(capture(engine, OTHER, ["resid_post.2"], push, progress=False)["resid_post.2"], steered)
    if engine.backend == "vllm":  # another set hooking resid_post.0 too: one Add, not one per registered set
        both = capture(engine, OTHER, ["resid_post.1", "resid_post.2"], push, progress=False)["resid_post.2"]
        assert torch.equal(both, steered)
    [status] = engine.runtime.worker_status()
    assert status["calls"] == 0 and status["hooks"] == 0, status
