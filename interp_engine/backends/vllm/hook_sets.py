"""The `vllm` backend's hooks: one set per set of points, registered once and armed while installed calls need it.

A set is the begin hook's company: every (layer, site) that hooks for one set of points (`needed_by` the installed
calls), built from the site table. Registering a set and removing it again was most of a small call's install in
the worker, paid twice a call; now a set stays registered after its calls end, dormant, and the next calls of
the same points arm it again. At most one set is armed, the one of exactly the installed calls' points; every
other hook returns at its first line (one identity compare: `when`), and with no call installed the begin hook
maps no rows. Dormant sets are dropped, least recently armed first, past `DORMANT_HOOKS` registered hooks, so a
plain step pays for at most that many no-op hooks. Every rank arms and drops alike (the calls decide, which
every rank sees in the same order), so the gathers inside the hooks still pair up. Nothing outlives the engine:
the hooks are on its model.
"""

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, experts
from interp_engine.backends.vllm.calls import WorkerCall
from interp_engine.backends.vllm.derived import expert_weights, head_results, record
from interp_engine.backends.vllm.layouts import layout_of
from interp_engine.backends.vllm.patterns import record_patterns, sharing, wants_patterns
from interp_engine.backends.vllm.sites import (LOGITS, Site, layer_positions, layer_sites, model_sites, module_of,
                                               parallel_mid, register)

# Hooks kept registered beyond the armed set's. A dormant hook costs every step ~2 us on a module with no other hook
# (torch's hooked call path and one identity compare, measured), so at most ~64 us a step.
DORMANT_HOOKS = 32


class HookSets:
    """One worker's hook sets (points -> handles, least recently armed first) and which one is armed."""

    def __init__(self, runner, state):
        self.runner, self.state = runner, state  # state: the worker's one StepState, read by every hook
        self.sets: dict[frozenset[Address], list] = {}
        self.armed: frozenset[Address] | None = None  # the key object itself: hooks compare by identity
        layers = compat.model(runner).get_submodule(layout_of(runner).layers)
        # Before every set's hooks (registered first, never removed): map this step's rows to calls, if any.
        self.begin = layers[0].register_forward_pre_hook(
            lambda m, args, kwargs: None if self.armed is None else state.begin(layer_positions(args, kwargs)),
            with_kwargs=True)

    @property
    def armed_count(self) -> int:
        """Hooks serving installed calls now, the begin hook included (0: none armed)."""
        return 0 if self.armed is None else len(self.sets[self.armed]) + 1

    def arm(self, needed: frozenset[Address] | None) -> None:
        """Arm the set of `needed` (registered on first use), or, with None, no set."""
        if needed is None:
            self.armed = None
            return
        key = next((k for k in self.sets if k == needed), None)  # the hooks know their set by its key object
        if key is None:
            key, handles = needed, self._register(needed)
        else:
            handles = self.sets.pop(key)
        self.sets[key] = handles  # most recently armed last
        self.armed = key
        while sum(map(len, self.sets.values())) - len(handles) > DORMANT_HOOKS:
            oldest = next(k for k in self.sets if k is not key)
            for handle in self.sets.pop(oldest):
                handle.remove()

    def close(self) -> None:
        for handles in self.sets.values():
            for handle in handles:
                handle.remove()
        self.sets.clear()
        self.begin.remove()
        self.armed = None

    def _register(self, key: frozenset[Address]) -> list:
        runner, state = self.runner, self.state
        layout = layout_of(runner)
        model = compat.model(runner)
        layers = model.get_submodule(layout.layers)
        # The (layer, site) pairs that hook for this set of points, found once per set: checking every site of
        # every layer (~110 on a 29M model, nearly all hooking nothing) was most of registering a set.
        sites = state.hooked.pop(key, None) or [(i, s) for i in range(len(layers)) for s in layer_sites(layout)] + \
            [(None, s) for s in model_sites(layout)]
        hooking, handles = [], []
        live = lambda: self.armed is key and bool(state.active)  # noqa: E731
        for i, site in sites:
            if new := _hook(site, model if i is None else layers[i], i, layout, state, key, model, live):
                hooking.append((i, site))
                handles += new
        for i in range(len(layers)) if layout.parallel else ():  # after the sites' hooks, which edit its terms
            if (mid := Address("resid_mid", i)) in key:
                handles += parallel_mid(layout, layers[i], lambda r, mid=mid: state.touch(mid, r, fresh=True),
                                        when=live)
        state.hooked[key] = hooking  # most recent last
        while len(state.hooked) > 64:
            state.hooked.pop(next(iter(state.hooked)))
        return handles


def needed_by(calls: dict[str, WorkerCall]) -> frozenset[Address]:
    """The points the calls' hooks serve."""
    return frozenset().union(*(c.ops.keys() | c.reads | c.lens for c in calls.values()))


def _hook(site: Site, root, layer: int | None, layout, state, needed: frozenset[Address], model, live) -> list:
    """The per-request hook of one site, if any installed call touches it: gather each point's shards, run
    every call's ops and reads on its rows, split edits back. It acts only while `live()`."""
    chains = [tuple(a for a in chain if a in needed) for chain in site.addresses(layer)]
    patterns = site.points == ("q", "k", "v") and wants_patterns(needed, layer, state.sources)
    logits = site.points == ("final",) and LOGITS in needed
    weights = Address("expert_weights", layer) if site.points == ("router_logits",) else None
    routing = weights in needed and state.routing is not None
    result = Address("attn_result", layer) if site.points == ("z",) else None
    results = result in needed
    each = Address("expert_out", layer) if site.points == ("router_logits",) else None
    each = each if each in needed and state.routing is not None else None
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
        if live():
            rows_in[:] = [args[0]]

    keep = [module.register_forward_pre_hook(keep_input)] if each else []
    return keep + [register(module, site, transform, when=live)]
