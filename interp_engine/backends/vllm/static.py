"""vllm-static: taps compiled into the model graph at load.

The worker class (`worker_cls`, a subclass of the platform's worker) installs the declared taps in
`load_model()`, before vLLM compiles the model (torch.compile; CUDA graphs on GPU). A tap's body is tensor
ops only, on buffers allocated once, so it is traced into the graph and replayed with it:

- a read copies the activation into a persistent buffer, `buf[:n].copy_(x)`;
- a write is `x * mul[:n] + add[:n]`, with every op of every request turned into per-row `mul`/`add` by
  `edits.affine` (identity rows for requests that do not edit there);
- at a point declared with an SAE, a Clamp's features then move by their slots' buffers (`static_clamp.py`),
  and rows that Splice take the declared SAE's reconstruction, computed from its buffers (`static_splice.py`).

No Python runs inside the model per step. Around each forward (in the runner's `_model_forward`, outside the
graph) the host fills the write buffers for this step's rows and, afterwards, copies out the rows of the calls
that read, gathers tensor-parallel shards, and computes what vLLM does not (logits at every position, the
logit lens, attention patterns from the tapped q and k, `taps.DERIVED`: attn_result from the tapped z,
expert_out from the tapped router logits and resid_mid). The calls, their tables and their results are the `vllm`
backend's (`worker.InterpExtension`), so the driver is the same.
"""

import functools
import hashlib
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from interp_engine import sae
from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, wire
from interp_engine.backends.vllm.patterns import record_patterns, sharing
from interp_engine.backends.vllm.static_clamp import ClampTap
from interp_engine.backends.vllm.static_splice import SpliceTap
from interp_engine.backends.vllm.sites import (FINAL, FLOAT32, LOGITS, Site, layer_sites, model_sites, module_at, module_of,
                                               parallel_mid, register)
from interp_engine.backends.vllm.derived import expert_weights, head_results, record
from interp_engine.backends.vllm.experts import record_expert_out
from interp_engine.backends.vllm.layouts import layout_of
from interp_engine.backends.vllm.worker import InterpExtension, StepState, WorkerCall
from interp_engine.edits import affine, failure
from interp_engine.spec import Clamp, Splice
from interp_engine.taps import DERIVED, PATTERNS, Taps

CONFIG_KEY = wire.CONFIG_KEY


@functools.cache
def _code_version() -> str:
    """The tap code's hash: part of vLLM's compile-cache key, so a graph traced by older taps is never reused
    (sae.py too: the compiled splice traces the SAE's own arithmetic)."""
    digest = hashlib.sha256()
    for path in (*sorted(Path(__file__).parent.glob("*.py")), Path(sae.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def engine_config(taps: Taps) -> dict:
    """`additional_config` for the engine. vLLM hashes it into the compile-cache key: one cache per tap set."""
    return {CONFIG_KEY: {**taps.to_config(), "code": _code_version()}}


def worker_cls(cuda: bool) -> str:
    return f"{__name__}.{'GPU' if cuda else 'CPU'}StaticWorker"


def _tap(read: Tensor | None, mul: Tensor | None, add: Tensor | None, clamp: ClampTap | None = None,
         splice: SpliceTap | None = None, whole: tuple[Callable, Callable] | None = None) -> Callable[[Tensor], Tensor]:
    """A tap body: tensor ops on persistent buffers, nothing else, so the compiler traces it in. `whole`: for an
    SAE tap at a sharded point under tensor parallelism, (gather, split) around the SAE taps, collectives in the
    graph that every rank runs alike, so the SAE sees the whole point and each rank keeps its slice."""
    def tap(x: Tensor) -> Tensor:
        n = x.shape[0]
        if mul is not None:
            x = x * mul[:n].view(x.shape) + add[:n].view(x.shape)
        if clamp is not None or splice is not None:
            y = x if whole is None else whole[0](x)
            if clamp is not None:
                y = clamp(y)
            if splice is not None:
                y = splice(y)
            x = y if whole is None else whole[1](y).reshape(x.shape)
        if read is not None:
            read[:n].copy_(x.reshape(n, -1))
        return x
    return tap


class StaticTaps:
    """The buffers and hooks of one worker's model, and the per-step work around the compiled forward."""

    def __init__(self, runner, taps: Taps, calls: dict[str, WorkerCall]):
        self.runner, self.taps = runner, taps
        self.model = compat.model(runner)
        self.layout = layout = layout_of(runner)
        self.state = StepState(runner, calls)
        self.shards = shards = self.state.shards
        self.layers = layers = list(self.model.get_submodule(layout.layers))
        # The module the patterns' scale is read from (under latent attention, DeepSeek's, the MLA attention); None at
        # a hybrid's Gated DeltaNet layers: no patterns there.
        self.attention = [module_at(layout, "mla" if layout.mla else "attention", layer) for layer in layers]
        self.d_model = compat.hidden_size(runner)
        self.sources = sources = self.state.sources  # a KV-shared layer's patterns need its source layer's k

        rows, dtype = compat.max_num_tokens(runner), compat.model_dtype(runner)
        device = next(self.model.parameters()).device
        # This rank's rows, flat, at the point's layer's own width: the taps run inside the model, on local shards.
        width = lambda a: shards.layer(a.layer).local_width(a.point, self.d_model)  # noqa: E731
        make = lambda a, fill: torch.full((rows, width(a)), fill, device=device,  # noqa: E731
                                          dtype=torch.float32 if a.point in FLOAT32 else dtype)
        buffers = {Address("k", sources[a.layer]) if a.point == "k" and a.layer in sources else a
                   for a in taps.buffers()}
        # Sorted: every rank walks them in the same order, so the gathers after a step pair up.
        self.reads = {a: make(a, 0.0) for a in sorted(buffers)}
        self.writes = {a: (make(a, 1.0), make(a, 0.0)) for a in sorted(taps.writes)}
        # SAE taps see the whole point at its layer's widths: gathered around them where this rank holds a slice.
        self.clamps = {a: ClampTap(rows, math.prod(shards.layer(a.layer).shape(a.point, self.d_model)), device)
                       for a in taps.clamps}
        self.splices = {a: SpliceTap(tuple(s for s in taps.splices if s.reads == a), rows, device)
                        for a in dict.fromkeys(s.reads for s in taps.splices)}
        bodies = {a: _tap(self.reads.get(a), *self.writes.get(a, (None, None)), self.clamps.get(a), self.splices.get(a),
                          self._whole(a) if a in self.clamps and shards.sharded(a.point) else None)
                  for a in self.reads.keys() | self.writes}
        self.handles = []
        for i, layer in enumerate(layers):
            for site in layer_sites(layout):
                self.handles += _tap_site(site, layer, i, layout, bodies)
        for site in model_sites(layout):
            self.handles += _tap_site(site, self.model, None, layout, bodies)
        for i, layer in enumerate(layers):  # after the sites' taps: formed from the tapped resid_pre and attn_out
            if layout.parallel and (mid := Address("resid_mid", i)) in bodies:
                self.handles += parallel_mid(layout, layer, bodies[mid], make(Address("resid_pre", i), 0.0))

    def _whole(self, address: Address) -> tuple[Callable, Callable]:
        point, shards = address.point, self.shards.layer(address.layer)
        shape = shards.shape(point, self.d_model)
        return (lambda x: shards.present(point, x.reshape(x.shape[0], -1)).reshape(x.shape[0], -1),
                lambda y: shards.split(point, y.view(y.shape[0], *shape)).reshape(y.shape[0], -1))

    # ------------------------------------------------------------------------------------------- per step
    def forward(self, forward: Callable, *args, **kwargs):
        """The runner's `_model_forward`, with this step's write rows filled before and reads taken after."""
        state = self.state
        if not state.calls:
            return forward(*args, **kwargs)
        n = compat.step_rows(self.runner)
        state.begin(kwargs["positions"][:n])
        if not state.active:
            return forward(*args, **kwargs)
        dirty = self._fill(n)
        try:
            out = forward(*args, **kwargs)
        finally:
            for mul, add in dirty:
                mul[:n].fill_(1.0)
                add[:n].zero_()
            for tap in (*self.clamps.values(), *self.splices.values()):
                tap.reset(n)
        self._read(n)
        return out

    def _fill(self, n: int) -> list[tuple[Tensor, Tensor]]:
        dirty = []
        for address, (mul, add) in self.writes.items():
            editing = [a for a in self.state.active if address in a.call.ops and not a.call.error]
            if not editing:
                continue
            shards = self.shards.layer(address.layer)
            shape = shards.shape(address.point, self.d_model)
            full_mul = torch.ones((n, *shape), dtype=mul.dtype, device=mul.device)
            full_add = torch.zeros_like(full_mul)
            if address in self.clamps:
                self.clamps[address].fill(editing, address)
            if address in self.splices:
                self.splices[address].fill(editing, address)
            for active in editing:
                ops = [op for op in active.call.ops[address] if not isinstance(op, Clamp | Splice)]  # the SAE taps'
                if not ops:
                    continue
                like = full_mul.new_zeros((1, len(active.rows), *full_mul.shape[1:]))
                try:  # contained to this call (its rows stay identity; no collective in here): WorkerCall.fail
                    m, a = affine(ops, like, address.info, active.step)
                    full_mul.index_copy_(0, active.rows, m[0])
                    full_add.index_copy_(0, active.rows, a[0])
                except Exception as e:
                    active.call.fail(str(failure(ops, e)), in_spec=True)
                    full_mul.index_fill_(0, active.rows, 1.0)
                    full_add.index_fill_(0, active.rows, 0.0)
            mul[:n].copy_(shards.split(address.point, full_mul).reshape(n, -1))
            add[:n].copy_(shards.split(address.point, full_add).reshape(n, -1))
            dirty.append((mul, add))
        return dirty

    def _read(self, n: int) -> None:
        state = self.state
        wanted = set().union(*(a.call.reads | a.call.lens for a in state.active))
        pattern_layers = {a.layer for a in wanted if a.point in PATTERNS}
        # with the layers whose keys they attend over (KV-shared layers'), which run first
        pattern_layers = sorted(pattern_layers | {self.sources[i] for i in pattern_layers if i in self.sources})
        qk: dict[Address, Tensor] = {}
        derived = sorted(a for a in wanted if a.point in DERIVED)
        sources = {Address(p, a.layer) for a in derived for p in DERIVED[a.point]}
        tapped: dict[Address, Tensor] = {}
        for address, buf in self.reads.items():
            needs_qk = address.point in ("q", "k") and address.layer in pattern_layers
            if (address not in wanted and not needs_qk and not (address == FINAL and LOGITS in wanted)
                    and address not in sources):
                continue
            x = self.shards.layer(address.layer).present(address.point, buf[:n])
            for active in state.active:
                if address in active.call.reads or address in active.call.lens:
                    state.keep(active, address, _rows(active, x, buf), copied=True)
            if address == FINAL and LOGITS in wanted:
                # vLLM's unembedding (vocab-parallel gathered: every rank takes part) at every row, not only
                # the sampled ones.
                logits = self.model.compute_logits(x)
                for active in state.active:
                    if LOGITS in active.call.reads:
                        state.keep(active, LOGITS, _rows(active, logits, None), copied=True)
            if address in sources:
                tapped[address] = x
            if needs_qk:
                qk[address] = x
        for address in derived:  # from the tapped rows (after any edit there), by the vllm backend's formulas
            self._derive(address, *(tapped[Address(p, address.layer)] for p in DERIVED[address.point]))
        for layer in pattern_layers:
            record_patterns(state, layer, qk.get(Address("q", layer)), qk.get(Address("k", layer)),
                            self.attention[layer], *sharing(self.sources, layer))

    def _derive(self, address: Address, x: Tensor, mid: Tensor | None = None) -> None:
        layer = self.layers[address.layer]
        if address.point == "expert_out":  # the experts' input is resid_mid's norm (or experts_norm's: Gemma 4)
            router, norm = self.layout.router, layer.get_submodule(self.layout.experts_norm or self.layout.mid_norm)
            record_expert_out(self.state, address, mid, x, self.state.routing(layer.get_submodule(router), layer),
                              layer.get_submodule(router.rpartition(".")[0]), norm)
        elif address.point == "expert_weights":
            record(self.state, address, lambda: expert_weights(
                x, self.state.routing(layer.get_submodule(self.layout.router), layer)))
        else:
            record(self.state, address, lambda: head_results(
                self.shards.layer(address.layer), x, layer.get_submodule(self.layout.o_proj)))


def _rows(active, x: Tensor, buf: Tensor | None) -> Tensor:
    """A call's rows of x, its own (`StepState.keep`'s `copied`). Where the call has the whole step, x as it is if
    it is not the tap buffer (gathered, or computed this step), or if the call ends in this step: it is written
    out after this forward (`_ie_hand_back`), before the next one overwrites the buffer, so a copy would only be
    copied again (32 MiB a call for resid_post x 8 at 64x32)."""
    call = active.call
    fresh = buf is None or x.data_ptr() != buf.data_ptr()
    ends = call.prompts and call.path and len(call.ended.union(active.ended)) == call.prompts
    return x if active.whole and (fresh or ends) else x.index_select(0, active.rows)


def _tap_site(site: Site, root, layer: int | None, layout, bodies: dict[Address, Callable]) -> list:
    """The tap of one site, if any of its points is tapped. Its structure is fixed here, at install: a traced
    hook cannot branch on a request."""
    chains = [tuple(bodies[a] for a in chain if a in bodies) for chain in site.addresses(layer)]
    module = module_of(site, layout, root) if any(chains) else None
    if module is None:  # nothing tapped here, or not in this layer
        return []

    def transform(xs):
        out = []
        for chain, x in zip(chains, xs):
            for body in chain:
                x = body(x)
            out.append(x)
        return tuple(out)

    return [register(module, site, transform)]


class StaticExtension(InterpExtension):
    """The `vllm` backend's RPC methods over permanent taps: a call's table only routes rows and fills buffers."""

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        config = compat.additional_config(self).get(CONFIG_KEY)
        if config is None:  # pragma: no cover - the driver always sends it
            raise RuntimeError(f"{type(self).__name__} needs additional_config[{CONFIG_KEY!r}] (its taps)")
        taps = Taps.from_config(config)
        runner = self.model_runner
        self._ie_static = StaticTaps(runner, taps, self._ie_calls())
        self._ie_wrap()

    def _ie_run(self, forward, *args, **kwargs):
        return self._ie_static.forward(forward, *args, **kwargs)

    def _ie_step_state(self) -> StepState:
        return self._ie_static.state

    def _ie_check(self, call: WorkerCall) -> None:
        taps = self._ie_static.taps
        for address in call.ops:
            if (problem := taps.refusal(address, write=True)) is not None:
                raise ValueError(str(problem))
        for address in call.reads | call.lens:
            if (problem := taps.refusal(address, write=False)) is not None:
                raise ValueError(str(problem))

    def ie_status(self) -> dict:
        return {**super().ie_status(), "hooks": 0, "taps": len(self._ie_static.handles)}

    def _ie_rehook(self) -> None:
        """Taps are permanent (compiled in); nothing to add or remove per call."""


def __getattr__(name: str):
    """`CPUStaticWorker` / `GPUStaticWorker`: the platform's worker with the taps, built on first use (importing
    the CUDA worker on a CPU-only machine, or the CPU one on GPU, is not free)."""
    if name not in ("CPUStaticWorker", "GPUStaticWorker"):
        raise AttributeError(name)
    base = compat.platform_worker(cuda=name == "GPUStaticWorker")
    cls = type(name, (StaticExtension, base), {"__module__": __name__})
    globals()[name] = cls
    return cls
