"""The driver side of the vLLM backends: one engine per process, hook tables per call, results as files.

Every call tags its requests with the call id, its first request carrying the call's table to the workers; a
prefill call's results are handed back in a file as its last position runs, a generation's collected. A call
that fails releases its table in the workers, so nothing outlives the call."""

import collections
import contextlib
import os
import threading
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.arch import Arch, Dims
from interp_engine.backends.base import TokenizerRuntime
from interp_engine.backends.vllm import compat, engine, results, wire
from interp_engine.backends.vllm.arena import ResultArena, Slot
from interp_engine.backends.vllm.call_requests import CallRequests
from interp_engine.backends.vllm.capabilities import for_handle
from interp_engine.backends.vllm.compat import resource_tracker_pid
from interp_engine.backends.vllm.dispatch import Dispatcher
from interp_engine.backends.vllm.life import EngineLife, shut_down_error
from interp_engine.backends.vllm.procs import close_children, deferred_interrupt, environ, exited, running
from interp_engine.backends.vllm.result_sizes import ResultSizes
from interp_engine.backends.vllm.weights import fetch as fetch_weights
from interp_engine.backends.vllm.wire import assemble, flatten
from interp_engine.errors import BackendError, LoadError, fix
from interp_engine.inputs import Prompts
from interp_engine.positions import at_positions
from interp_engine.taps import Taps
from interp_engine.validate import Plan

__all__ = ["VllmRuntime", "assemble", "flatten", "resource_tracker_pid"]
LOGITS = Address("logits")
# vLLM engines are process-wide (worker processes, distributed state): one may be live per process.
_LIVE: dict[str, "VllmRuntime"] = {}
_LIVE_LOCK = threading.Lock()
STREAM_DEPTH = 2  # chunks a stream keeps in the engine at once: the one being finished and the next, behind it


class VllmRuntime(TokenizerRuntime):
    def __init__(self, *, source: str | Path, name: str, backend: str, arch: Arch, dims: Dims, dtype: torch.dtype,
                 num_gpus: int, engine_kwargs: Mapping[str, Any], tokenizer, taps: Taps | None = None):
        self.source, self.name, self.backend, self.arch, self.dims = source, name, backend, arch, dims
        self.taps = taps  # vllm-static: what the engine is compiled with
        self.capabilities = for_handle(backend, taps, arch.vllm)
        self.dtype, self.num_gpus, self.engine_kwargs, self.tokenizer = dtype, num_gpus, dict(engine_kwargs), tokenizer
        self.llm, self._procs, self._sockets = None, [], None  # _sockets: see engine.SOCKETS
        self._tables: dict[str, dict] = {}  # spec fingerprint -> compiled table (plain data), driver side only
        self._lock = threading.Lock()  # loading, unloading and the table cache
        self._dispatch = Dispatcher()  # the engine lock, and which call owns each request in flight
        # Bumped by unload: a call that entered before a shutdown() fails rather than load the engine again.
        self._epoch, self._entered = 0, threading.local()
        self._life: EngineLife | None = None  # the live engine's processes, watchdog and guard
        self._calls: dict[str, EngineLife] = {}  # call id -> the engine its table went to, until collected
        self._attached = None  # the engine whose workers adopt tables from requests (ATTACH, once per engine)
        self._sizes = ResultSizes()  # results' sizes by kind of call: arena slots, files reserved ahead
        self._slots: dict[str, tuple[ResultArena, Slot]] = {}  # call -> its arena slot, until read or released

    @property
    def is_loaded(self) -> bool:
        return self.llm is not None

    def load(self):
        with self._lock:
            if self.llm is not None:
                return self.llm
            with _LIVE_LOCK:
                other = next(iter(_LIVE.values()), None)
                if other is not None and other is not self:
                    raise BackendError(fix(
                        f"a vLLM model ({other.name!r}) is already live in this process; vLLM holds one engine "
                        "per process.", f"await model.shutdown() on {other.name!r} before loading {self.name!r}."))
                _LIVE[self.name] = self
            try:
                import psutil

                before = {p.pid for p in psutil.Process().children(recursive=True)}
                self.llm = self._engine()
                # Exactly the processes this engine started: shutdown() waits for (and if need be kills) these;
                # not Python's resource tracker, which spawn starts once per process and every later spawn reuses.
                self._procs = [p for p in psutil.Process().children(recursive=True)
                               if p.pid not in before and p.pid != resource_tracker_pid()]
                self._life = EngineLife(self.llm, self._procs, self.name, self._sockets)
            except BaseException:
                engine.remove_sockets(self._sockets)
                with _LIVE_LOCK:
                    _LIVE.pop(self.name, None)
                raise
            return self.llm

    def _engine(self):
        compat.check_version()  # an unsupported vLLM is refused here, not deep in a worker
        LLM = engine.imported(_llm_class)
        kwargs, env = engine.settings(self)
        self._sockets = env.get(engine.SOCKETS)
        try:
            with environ(env):  # for the engine's start only: its processes start inside LLM() and inherit it
                return LLM(**kwargs)
        except (OSError, ValueError) as e:
            raise LoadError(fix(f"vLLM could not load {self.name!r}: {e}",
                                'check the checkpoint and engine settings, or use backend="eager".')) from None

    def unload(self) -> None:
        with self._lock:
            llm, self.llm = self.llm, None
            with _LIVE_LOCK:
                if _LIVE.get(self.name) is self:
                    del _LIVE[self.name]
        if llm is None:
            return
        procs, self._procs = self._procs, []
        life, self._life = self._life, None
        self._epoch += 1
        self._dispatch.owners.clear()
        # A faulted engine's processes have nothing to finish: give them 2 s, not 20, before they are killed.
        grace = 20 if life is None or life.fault is None else 2
        if life is not None:
            life.end()  # calls in flight fail now, rather than wait on an engine that is going away
        try:
            with life.send_lock if life is not None else contextlib.nullcontext():  # no message half sent
                compat.shutdown(llm)
        finally:
            # No gc.collect(): a full collection of a process holding vLLM, torch and transformers took 1-3 s
            # here, and the soak run (benchmarks/soak.py) shows no descriptor or memory growth without it.
            del llm
            close_children({p.pid for p in procs}, grace)
            for process in exited(procs, grace):
                process.kill()
                exited([process], 5)
            if life is not None:
                life.release()

    # ------------------------------------------------------------------------------------------- calls
    def _rpc(self, method: str, *args):
        """An RPC to every worker. A call's COLLECT or RELEASE go to the engine its first contact reached
        (`_attach`), or fail if that one is gone: never another."""
        if method in (wire.COLLECT, wire.RELEASE):
            life = self._calls.pop(args[0], None)
            if method == wire.RELEASE and (life is None or life.fault is not None):
                return []  # a shut down or dead engine holds no tables; the call's error is on its way
            if life is None:
                raise shut_down_error(self.name)
        else:
            life = self._attach(None)
        with deferred_interrupt(), self._dispatch.lock, life.waiting():  # see Dispatcher.finish: the wait is a Condition's
            return life.llm.collective_rpc(method, args=args)

    def _attach(self, call: str | None) -> EngineLife:
        """The engine for a call's first contact, loaded if need be (unless the call entered before a
        shutdown()), and remembered for the call's table."""
        if getattr(self._entered, "epoch", None) not in (None, self._epoch):
            raise shut_down_error(self.name)
        self.load()
        life = self._life
        if life is None:  # shutdown() came between the load and here
            raise shut_down_error(self.name)
        if call is not None:
            self._calls[call] = life
        return life

    @contextlib.contextmanager
    def calling(self):
        """A public call's span on this thread: if shutdown() runs meanwhile, the call fails, never loads again."""
        outer = getattr(self._entered, "epoch", None)
        self._entered.epoch = self._epoch if outer is None else outer
        try:
            yield
        finally:
            self._entered.epoch = outer

    def forward(self, prompts: Prompts, plan: Plan, **kwargs) -> tuple[Tensor | None, dict[Address, Tensor]]:
        return self._prefill(prompts, plan, **kwargs)

    def lens(self, prompts: Prompts, plan: Plan, *, batch_size: int, progress: bool = True) -> dict[Address, Tensor]:
        """The logit lens computed in the workers (final norm + vLLM's own logits path, vocab-parallel gathered),
        so only log-probs cross to the driver, never the residual stream."""
        lensed = Plan(plan.ops, ())
        _, records = self._prefill(prompts, lensed, batch_size=batch_size, want_logits=False, progress=progress,
                                   lens=plan.reads)
        return records

    def generate(self, prompts: Prompts, plan: Plan, **kwargs) -> tuple[list[list[int]], dict[Address, Tensor]]:
        return self._generate(prompts, plan, **kwargs)

    def _prefill(self, prompts: Prompts, plan: Plan, *, batch_size: int, want_logits: bool, progress: bool = True,
                 lens: tuple[Address, ...] = (), logits_at: Tensor | None = None):
        """Prefill every prompt once (max_tokens=1) with the call's table installed; vLLM batches them."""
        reads = list(dict.fromkeys([*plan.reads, *([LOGITS] if want_logits else [])]))
        call = uuid.uuid4().hex
        with self._table(call):
            tokens = sum(prompts.lengths)
            table = self._install(call, plan, reads, width=max(prompts.lengths), lens=lens, prompts=len(prompts),
                                  tokens=tokens)
            self._run(call, *wire.prefill_requests(call, prompts, table), progress=progress and len(prompts) > 1,
                      then=lambda: self._sizes.reserve(table, tokens))
            blob = self._collect(call, table, tokens)
        records = assemble(blob, reads or list(lens), prompts.lengths, lens=bool(lens))
        logits = records.get(LOGITS) if want_logits else None  # the workers hand back every position's logits
        logits = logits if logits is None or logits_at is None else at_positions(logits, logits_at, dim=1)
        if LOGITS not in plan.reads:
            records.pop(LOGITS, None)
        return logits, records

    def stream(self, chunks: Iterable[tuple[Prompts, Plan]], *, batch_size: int
               ) -> Iterator[tuple[Prompts, dict[Address, Tensor]]]:
        """Capture chunk after chunk, each its own call (table, requests, collect), with the next chunk's
        requests queued before this one's finish: vLLM's batch does not drain at a chunk's end, and the driver's
        work on a finished chunk (collect, flatten, whatever the consumer does) overlaps the engine's on the
        next. Yields each chunk's reads as flat rows, [its tokens, ...], prompt after prompt, in chunk order."""
        del batch_size  # vLLM's scheduler batches
        source = iter(chunks)
        flight: collections.deque[tuple[CallRequests, Prompts, tuple[Address, ...]]] = collections.deque()
        tables: dict[str, dict] = {}
        try:
            while True:
                while len(flight) < STREAM_DEPTH and (item := next(source, None)) is not None:
                    prompts, plan = item
                    requests = CallRequests(uuid.uuid4().hex)
                    flight.append((requests, prompts, tuple(plan.reads)))
                    table = tables[requests.call] = self._install(
                        requests.call, plan, list(plan.reads), width=max(prompts.lengths), prompts=len(prompts),
                        tokens=sum(prompts.lengths))
                    self._submit(requests, *wire.prefill_requests(requests.call, prompts, table))
                    self._sizes.reserve(table, sum(prompts.lengths))
                if not flight:
                    return
                requests, prompts, reads = flight[0]
                self._dispatch.finish(requests)
                blob = self._collect(requests.call, tables.pop(requests.call), sum(prompts.lengths))
                flight.popleft()
                yield prompts, flatten(blob, reads, prompts.lengths)
        finally:  # an error, or the consumer stopped: nothing of these calls may stay in the engine
            for requests, _, _ in flight:
                self._dispatch.abort(requests)
                self._release(requests.call)

    def _generate(self, prompts: Prompts, plan: Plan, *, max_new_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, seed: int | None, stop_at_eos: bool, batch_size: int,
                 progress: bool = True) -> tuple[list[list[int]], dict[Address, Tensor]]:
        """Generate with the call's table in every step. Captures need the last new token fed back once more,
        so they ask for one extra token (and ignore EOS, trimming afterwards): every kept token has its row."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        call = uuid.uuid4().hex
        tabled = bool(plan.ops or plan.reads)  # a plain request installs nothing (and vllm-generate can't)
        capturing = bool(plan.reads)
        eos = self.eos_id
        with self._table(call) if tabled else contextlib.nullcontext():
            table = self._install(call, plan, list(plan.reads)) if tabled else None
            params = [SamplingParams(
                max_tokens=max_new_tokens + capturing, temperature=temperature, top_k=top_k or 0,
                top_p=top_p or 1.0, seed=None if seed is None else seed + i, detokenize=False,
                ignore_eos=True, stop_token_ids=[eos] if stop_at_eos and eos is not None and not capturing else None,
                skip_reading_prefix_cache=tabled, output_kind=RequestOutputKind.FINAL_ONLY, skip_clone=True,
                extra_args=wire.tag(call, i, len(ids), table if i == 0 else None, len(prompts.ids)) if tabled else None)
                for i, ids in enumerate(prompts.ids)]
            outputs = self._run(call, [tokens_input(list(ids), cache_salt=call if tabled else None)
                                       for ids in prompts.ids], params, progress=progress and len(prompts) > 1)
            blob = self._collect(call) if tabled else {}
        new = []
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)[:max_new_tokens]
            if stop_at_eos and eos is not None and eos in tokens:
                tokens = tokens[: tokens.index(eos) + 1]
            new.append(tokens)
        records = assemble(blob, list(plan.reads), tuple(len(t) for t in new), offsets=prompts.lengths)
        return new, records

    def _collect(self, call: str, table: dict | None = None, tokens: int = 0) -> dict[str, Tensor]:
        """Rank 0's records: the arena slot or file a prefill call was handed back in (`table`'s; its size is
        learnt for the next call of its kind), else COLLECT's (a generation, another host). Either way the
        workers hold nothing of the call afterwards, so a slot not handed over is free again."""
        path = wire.result_path(call)
        held = self._slots.pop(call, None)
        try:
            if held is not None and (nbytes := held[0].written(held[1])):
                self._calls.pop(call, None)
                arena, slot = held
                held = None  # handed over with the result: free again once the caller drops it (arena.py)
                self._sizes.learn(table, tokens, nbytes)
                return wire.decode(arena.hand_over(slot, nbytes))
            if results.written(path):  # handed back as its last position ran: the workers hold nothing of it
                self._calls.pop(call, None)
                self._sizes.learn(table, tokens, os.path.getsize(path))
                return wire.decode(path)
            return wire.decode(wire.result(self._rpc(wire.COLLECT, call, path, wire.host())))
        finally:
            if held is not None:
                held[0].give(held[1])
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    @contextlib.contextmanager
    def _table(self, call: str):
        """A call's table is in the workers until handed back or collected; a failure (an interrupt too) releases it."""
        try:
            yield
        except BaseException:
            self._release(call)
            raise

    def _release(self, call: str) -> None:
        life = self._calls.get(call)
        try:
            self._rpc(wire.RELEASE, call)
        finally:  # a faulted engine's slot stays taken: a stopped worker might yet write it
            if (held := self._slots.pop(call, None)) is not None and life is not None and life.fault is None:
                held[0].give(held[1])
        with contextlib.suppress(FileNotFoundError):  # after RELEASE no worker writes it; one written before goes
            os.unlink(wire.result_path(call))

    def _install(self, call: str, plan: Plan, reads: list[Address], width: int = 0,
                 lens: tuple[Address, ...] = (), prompts: int = 0, tokens: int = 0) -> dict:
        """The call's table, for its first request's tag (workers adopt tables once attached: one RPC per engine);
        a prefill call's (`tokens` prompt tokens) with an arena slot sized from the last of its kind."""
        spec = plan.spec()
        key = spec.fingerprint()
        with self._lock:
            compiled = self._tables.pop(key, None) or spec.to_dict()
            self._tables[key] = compiled  # most recent last; serialising large Patch sources once is worth it
            while len(self._tables) > 32:
                self._tables.pop(next(iter(self._tables)))
        life = self._attach(call)  # the call's engine, from here to its end (loaded on a first call)
        if self._attached is not life.llm:
            self._rpc(wire.ATTACH)
            self._attached = life.llm
        compiled = life.saes.put(call, spec, compiled, self._calls, lambda *a: self._rpc(wire.PUT_SAES, *a))
        table = wire.table(call, compiled, key, reads, width=width, lens=lens, prompts=prompts)
        if prompts and (slot := life.arena.take(self._sizes.expect(table, tokens))) is not None:
            self._slots[call] = life.arena, slot
            table = wire.with_slot(table, life.arena.table(slot))
        return table

    weights = fetch_weights  # TransformerLens-shaped, from the workers once per engine

    def worker_status(self) -> list[dict]:
        tabled = self.capabilities.points  # vllm-generate installs nothing
        return self._rpc(wire.STATUS) if self.llm is not None and tabled else []

    def worker_saes(self) -> list[dict]:  # per worker: the SAEs it holds (sae_refs.held)
        return self._rpc(wire.SAES) if self.llm is not None and self.capabilities.points else []

    def _run(self, call: str, inputs: list, params: list, *, progress: bool, then=None) -> list:
        """Add the call's requests, run `then()` (the driver's work while they compute), step the engine until all
        have finished; their outputs, in order. On any exception (a KeyboardInterrupt included) its unfinished
        requests are aborted: they reach no other call."""
        requests = CallRequests(call)
        try:
            self._submit(requests, inputs, params)
            if then is not None:
                then()
            self._dispatch.finish(requests, progress=progress)
        except BaseException:
            self._dispatch.abort(requests)
            raise
        return [requests.outputs[i] for i in requests.ids]

    def _submit(self, requests: CallRequests, inputs: list, params: list) -> None:
        if requests.life is None:
            requests.life = self._calls.get(requests.call) or self._attach(None)
        self._dispatch.submit(requests, inputs, params)

    def is_alive(self) -> bool:
        """False once the engine is faulted (a process exited or stopped, the protocol died: life.py) or dead."""
        life = self._life
        if life is None or life.fault is not None:
            return False
        return not compat.is_engine_dead(life.llm) and running(life.procs)


def _llm_class():
    from vllm import LLM

    return LLM
