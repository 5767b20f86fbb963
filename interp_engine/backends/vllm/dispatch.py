"""The driver's traffic with a vLLM engine: requests in, steps run, each finished output to the call owning it.

vLLM's sync client is not thread-safe: one thread talks to the engine at a time, a step or an RPC at a time.
Calls from several threads interleave there, so their requests share vLLM's batches."""

import contextlib
import threading

from interp_engine.backends.vllm import compat, wire
from interp_engine.backends.vllm.call_requests import CallRequests
from interp_engine.backends.vllm.procs import deferred_interrupt


class Dispatcher:
    """The engine lock and the owner of every request in flight (request id -> its call, until its output)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.owners: dict[str, CallRequests] = {}

    def submit(self, requests: CallRequests, inputs: list, params: list) -> None:
        """Add a call's requests (`requests.life` set: the engine they go to)."""
        with self.lock, requests.life.waiting():  # a dead engine is reported as such, not as vLLM's
            for prompt, param in zip(inputs, params):
                request = wire.request_id(requests.call, len(requests.ids))
                # Recorded before it is added: an interrupt inside add_request still finds it to abort.
                requests.ids.append(request)
                requests.waiting.add(request)
                self.owners[request] = requests
                compat.add_request(requests.life.llm, request, prompt, param)

    def finish(self, requests: CallRequests, *, progress: bool = False) -> None:
        """Step the engine until these requests have finished. Another thread's call may be stepping it too: each
        step's finished outputs go to the call owning them, so calls share batches and wait only for the step."""
        from interp_engine.progress import bar as progress_bar
        from interp_engine.progress import showing

        life = requests.life
        if life is None:  # nothing was submitted
            return
        llm = life.llm
        # No bar at all unless one is drawn: a disabled tqdm still cost a small call ~0.1 ms.
        shown = showing(progress)
        bar = progress_bar(total=len(requests.ids), desc="Processed prompts", progress=progress,
                           dynamic_ncols=True) if shown else contextlib.nullcontext()
        with bar:
            while requests.waiting:
                # Ctrl-C lands after the step: inside a Condition's wait (queue.get) it can become "RuntimeError:
                # release unlocked lock". Steps are short (chunked prefill); a dead engine's fails at once.
                with deferred_interrupt(), self.lock, life.waiting():
                    if not requests.waiting:  # checked after the lock: the thread that
                        break  # held it may have failed on a faulted engine
                    for out in compat.step(llm):
                        if out.finished and (owner := self.owners.pop(out.request_id, None)) is not None:
                            owner.waiting.discard(out.request_id)
                            owner.outputs[out.request_id] = out
                if shown:
                    bar.update(len(requests.outputs) - bar.n)

    def abort(self, requests: CallRequests) -> None:
        """Take this call's unfinished requests out of the engine."""
        with contextlib.suppress(Exception), self.lock:  # the original error matters more
            for request in requests.ids:
                self.owners.pop(request, None)
            life = requests.life
            if requests.waiting and life is not None and life.fault is None:
                compat.abort_requests(life.llm, list(requests.waiting))
            requests.waiting.clear()
