"""vllm-static: taps compiled into the model graph at load.

The worker class (`worker_cls`, a subclass of the platform's worker) installs the declared taps in
`load_model()`, before vLLM compiles the model (torch.compile; CUDA graphs on GPU). A tap's body is tensor
ops only, on buffers allocated once, so it is traced into the graph and replayed with it:

- a read copies the activation into a persistent buffer, `buf[:n].copy_(x)`;
- a write is `x * mul[:n] + add[:n]`, with every op of every request turned into per-row `mul`/`add` by
  `edits.affine` (identity rows for requests that do not edit there).

No Python runs inside the model per step. Around each forward (in the runner's `_model_forward`, outside the
graph) the host fills the write buffers for this step's rows and, afterwards, copies out the rows of the calls
that read, gathers tensor-parallel shards, and computes what vLLM does not (logits at every position, the
logit lens, attention patterns from the tapped q and k). The calls, their tables and their results are the
`vllm` backend's (`worker.InterpExtension`), so the driver is the same.
"""

import functools
import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm.worker import (EMBED, FINAL, LOGITS, InterpExtension, StepState, WorkerCall,
                                                _layer_args, _layout, _with_layer_args, record_patterns)
from interp_engine.edits import affine
from interp_engine.taps import PATTERNS, Taps

CONFIG_KEY = "interp_engine"


@functools.cache
def _code_version() -> str:
    """The tap code's hash: part of vLLM's compile-cache key, so a graph traced by older taps is never reused."""
    digest = hashlib.sha256()
    for name in ("static.py", "worker.py"):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def engine_config(taps: Taps) -> dict:
    """`additional_config` for the engine. vLLM hashes it into the compile-cache key: one cache per tap set."""
    return {CONFIG_KEY: {**taps.to_config(), "code": _code_version()}}


def worker_cls(cuda: bool) -> str:
    return f"{__name__}.{'GPU' if cuda else 'CPU'}StaticWorker"


def _tap(read: Tensor | None, mul: Tensor | None, add: Tensor | None) -> Callable[[Tensor], Tensor]:
    """A tap body: tensor ops on persistent buffers, nothing else, so the compiler traces it in."""
    def tap(x: Tensor) -> Tensor:
        n = x.shape[0]
        if mul is not None:
            x = x * mul[:n].view(x.shape) + add[:n].view(x.shape)
        if read is not None:
            read[:n].copy_(x.reshape(n, -1))
        return x
    return tap


class StaticTaps:
    """The buffers and hooks of one worker's model, and the per-step work around the compiled forward."""

    def __init__(self, runner, taps: Taps, calls: dict[str, WorkerCall]):
        self.runner, self.taps = runner, taps
        self.model = runner.get_model()
        self.layout = _layout(runner)
        self.state = StepState(runner, calls)
        shards = self.state.shards
        layers = list(self.model.get_submodule(self.layout.layers))
        self.attention = [layer.get_submodule(self.layout.attention) for layer in layers]
        first = self.attention[0]
        mlp_local = layers[0].get_submodule(self.layout.mlp_down).input_size_per_partition
        d_model = runner.model_config.get_hidden_size()
        # Per point: heads (or neurons) on this rank, and the shape a capture presents (gathered).
        self.local = {"q": first.num_heads, "z": first.num_heads, "k": first.num_kv_heads, "v": first.num_kv_heads,
                      "mlp_act": mlp_local}
        d_head = first.head_size
        self.shape = {"q": (first.num_heads * shards.size, d_head), "z": (first.num_heads * shards.size, d_head),
                      "k": (shards.kv_total, d_head), "v": (shards.kv_total, d_head), "mlp_act": (mlp_local * shards.size,)}
        width = {"q": first.num_heads * d_head, "z": first.num_heads * d_head, "k": first.num_kv_heads * d_head,
                 "v": first.num_kv_heads * d_head, "mlp_act": mlp_local}
        self.d_model = d_model

        rows, dtype = runner.max_num_tokens, runner.model_config.dtype
        device = next(self.model.parameters()).device
        make = lambda a, fill: torch.full((rows, width.get(a.point, d_model)), fill, dtype=dtype, device=device)  # noqa: E731
        # Sorted: every rank walks them in the same order, so the gathers after a step pair up.
        self.reads = {a: make(a, 0.0) for a in taps.buffers()}
        self.writes = {a: (make(a, 1.0), make(a, 0.0)) for a in sorted(taps.writes)}
        bodies = {a: _tap(self.reads.get(a), *self.writes.get(a, (None, None))) for a in self.reads.keys() | self.writes}
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles += _layer_taps(layer, i, self.layout, bodies)
        final = bodies[FINAL]

        def final_tap(module, args, out):
            normed = out[0] if isinstance(out, tuple) else out
            edited = final(normed)
            if edited is normed:
                return None
            return (edited, *out[1:]) if isinstance(out, tuple) else edited
        self.handles.append(self.model.get_submodule(self.layout.final_norm).register_forward_hook(final_tap))

    # ------------------------------------------------------------------------------------------- per step
    def forward(self, forward: Callable, *args, **kwargs):
        """The runner's `_model_forward`, with this step's write rows filled before and reads taken after."""
        state = self.state
        if not state.calls:
            return forward(*args, **kwargs)
        runner = self.runner
        n = int(runner.query_start_loc.np[runner.input_batch.num_reqs])
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
        self._read(n)
        return out

    def _fill(self, n: int) -> list[tuple[Tensor, Tensor]]:
        dirty = []
        for address, (mul, add) in self.writes.items():
            editing = [a for a in self.state.active if address in a.call.ops]
            if not editing:
                continue
            full_mul = torch.ones((n, *self._shape(address)), dtype=mul.dtype, device=mul.device)
            full_add = torch.zeros_like(full_mul)
            for active in editing:
                like = full_mul.new_zeros((1, len(active.rows), *full_mul.shape[1:]))
                m, a = affine(active.call.ops[address], like, address.info, active.step)
                full_mul.index_copy_(0, active.rows, m[0])
                full_add.index_copy_(0, active.rows, a[0])
            mul[:n].copy_(self._split(address, full_mul))
            add[:n].copy_(self._split(address, full_add))
            dirty.append((mul, add))
        return dirty

    def _read(self, n: int) -> None:
        state = self.state
        wanted = set().union(*(a.call.reads | a.call.lens for a in state.active))
        pattern_layers = sorted({a.layer for a in wanted if a.point in PATTERNS})
        qk: dict[Address, Tensor] = {}
        for address, buf in self.reads.items():
            needs_qk = address.point in ("q", "k") and address.layer in pattern_layers
            if address not in wanted and not needs_qk and not (address == FINAL and LOGITS in wanted):
                continue
            x = self._present(address, buf[:n])
            for active in state.active:
                if address in active.call.reads or address in active.call.lens:
                    state.keep(active, address, x.index_select(0, active.rows), copied=True)
            if address == FINAL and LOGITS in wanted:
                # vLLM's unembedding (vocab-parallel gathered: every rank takes part) at every row, not only
                # the sampled ones.
                logits = self.model.compute_logits(x)
                for active in state.active:
                    if LOGITS in active.call.reads:
                        state.keep(active, LOGITS, logits.index_select(0, active.rows), copied=True)
            if needs_qk:
                qk[address] = x
        for layer in pattern_layers:
            record_patterns(state, layer, qk[Address("q", layer)], qk[Address("k", layer)], self.attention[layer])

    # ------------------------------------------------------------------------------------------- shards
    def _shape(self, address: Address) -> tuple[int, ...]:
        return self.shape.get(address.point, (self.d_model,))

    def _present(self, address: Address, flat: Tensor) -> Tensor:
        """This rank's [n, width] rows -> the point's gathered [n, ...] rows."""
        point, shards = address.point, self.state.shards
        if point in ("q", "z"):
            return shards.gather(flat.reshape(len(flat), self.local[point], -1), 1)
        if point in ("k", "v"):
            return shards.gather_kv(flat.reshape(len(flat), self.local[point], -1))
        if point == "mlp_act":
            return shards.gather(flat, -1)
        return flat

    def _split(self, address: Address, full: Tensor) -> Tensor:
        """The inverse of `_present`: this rank's share of gathered rows, as [n, width]."""
        point, shards = address.point, self.state.shards
        if point in ("q", "z"):
            full = shards.split(full, 1, self.local[point])
        elif point in ("k", "v"):
            full = shards.split_kv(full, self.local[point])
        elif point == "mlp_act":
            full = shards.split(full, -1, self.local[point])
        return full.reshape(len(full), -1)


def _layer_taps(layer, i: int, layout, bodies: dict[Address, Callable]) -> list:
    """The hooks of one decoder layer. Each one's structure is fixed here, at install: a traced hook cannot
    branch on a request."""
    tap = lambda point: bodies.get(Address(point, i))  # noqa: E731
    embed, pre, mid = bodies.get(EMBED) if i == 0 else None, tap("resid_pre"), tap("resid_mid")
    handles = []

    if embed or pre:
        def layer_in(module, args, kwargs):
            _, hidden, residual = _layer_args(args, kwargs)
            x = hidden if residual is None else hidden + residual
            y = embed(x) if embed else x
            y = pre(y) if pre else y
            if y is x:
                return None
            # vLLM carries the stream as (hidden, residual) and adds them first thing: hand it (y, 0).
            return _with_layer_args(args, kwargs, y, None if residual is None else torch.zeros_like(residual))
        handles.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))

    q, k, v = tap("q"), tap("k"), tap("v")
    if q or k or v:
        def attn_in(module, args):
            new = tuple(t(x) if t else x for t, x in zip((q, k, v), args[:3]))
            return None if all(a is b for a, b in zip(new, args)) else (*new, *args[3:])
        handles.append(layer.get_submodule(layout.attention).register_forward_pre_hook(attn_in))

    for point, path in (("z", layout.o_proj), ("mlp_act", layout.mlp_down)):
        if body := tap(point):
            def module_in(module, args, body=body):
                x = body(args[0])
                return None if x is args[0] else (x, *args[1:])
            handles.append(layer.get_submodule(path).register_forward_pre_hook(module_in))

    for point, path in (("attn_out", layout.attn_out), ("mlp_out", layout.mlp_out)):
        if body := tap(point):
            def module_out(module, args, out, body=body):
                x = body(out)
                return None if x is out else x
            handles.append(layer.get_submodule(path).register_forward_hook(module_out))

    if mid:
        def mid_in(module, args):
            hidden, residual = args[:2]
            r = hidden + residual
            y = mid(r)
            # Capture only: leave the fused add to the norm. A write hands it (y, 0): it adds 0 to y.
            return None if y is r else (y, torch.zeros_like(residual), *args[2:])
        handles.append(layer.get_submodule(layout.mid_norm).register_forward_pre_hook(mid_in))

    if post := tap("resid_post"):
        def layer_out(module, args, out):
            hidden, residual = out
            x = hidden + residual
            y = post(x)
            return None if y is x else (y, torch.zeros_like(residual))
        handles.append(layer.register_forward_hook(layer_out))
    return handles


class StaticExtension(InterpExtension):
    """The `vllm` backend's RPC methods over permanent taps: a call's table only routes rows and fills buffers."""

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        config = (self.vllm_config.additional_config or {}).get(CONFIG_KEY)
        if config is None:  # pragma: no cover - the driver always sends it
            raise RuntimeError(f"{type(self).__name__} needs additional_config[{CONFIG_KEY!r}] (its taps)")
        taps = Taps(tuple(map(Address.parse, config["reads"])), tuple(map(Address.parse, config["writes"])))
        runner = self.model_runner
        self._ie_static = StaticTaps(runner, taps, self._ie_calls())
        forward = runner._model_forward
        runner._model_forward = functools.partial(self._ie_static.forward, forward)

    def ie_install(self, table: dict) -> bool:
        call = WorkerCall.from_table(table)
        taps = self._ie_static.taps
        for address in call.ops:
            if (problem := taps.refusal(address, write=True)) is not None:
                raise ValueError(str(problem))
        for address in call.reads | call.lens:
            if (problem := taps.refusal(address, write=False)) is not None:
                raise ValueError(str(problem))
        self._ie_calls()[table["call"]] = call
        return True

    def ie_status(self) -> dict:
        return {"calls": len(self._ie_calls()), "hooks": 0, "taps": len(self._ie_static.handles)}

    def _ie_rehook(self) -> None:
        """Taps are permanent (compiled in); nothing to add or remove per call."""


def __getattr__(name: str):
    """`CPUStaticWorker` / `GPUStaticWorker`: the platform's worker with the taps, built on first use (importing
    the CUDA worker on a CPU-only machine, or the CPU one on GPU, is not free)."""
    if name not in ("CPUStaticWorker", "GPUStaticWorker"):
        raise AttributeError(name)
    if name == "CPUStaticWorker":
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    else:
        from vllm.v1.worker.gpu_worker import Worker as base
    cls = type(name, (StaticExtension, base), {"__module__": __name__})
    globals()[name] = cls
    return cls
