"""One call's hooks: where each point is read and written on a HF model, installed and removed per call.

A `Run` holds the call's ops per address, the addresses to record, optional zero deltas (for gradients) and
what was recorded. `installed()` registers only the hooks the run needs and removes them in `finally`.
"""

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from einops import rearrange
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.arch import Arch
from interp_engine.backends.eager.attention import SITE_KW, eager_pattern
from interp_engine.edits import Step, apply, failure
from interp_engine.errors import InterpEngineError

EMBED, FINAL = Address("embed"), Address("final")
# HF attention holds q, k, v head-major; our points present them position-major (typing.Heads / KVHeads).
_TO_POINT = "batch heads pos d_head -> batch pos heads d_head"
_TO_HF = "batch pos heads d_head -> batch heads pos d_head"


class Run:
    """Edits, reads and records of one call. Created inside the call and dropped with it."""

    def __init__(self, ops: Mapping[Address, tuple], reads: frozenset[Address],
                 deltas: Mapping[Address, Tensor] | None = None):
        self.ops = ops
        self.reads = reads
        self.deltas = deltas or {}
        self.records: dict[Address, list[Tensor]] = {}
        self.stash: dict[int, Tensor] = {}
        self.step: Step | None = None

    def wants(self, address: Address) -> bool:
        return address in self.ops or address in self.reads or address in self.deltas

    def touch(self, address: Address, x: Tensor, present=None) -> Tensor:
        """Apply this address's edits in spec order, add its delta, record it. Returns x itself if untouched."""
        for op in self.ops.get(address, ()):
            try:
                x = apply(op, x, address.info, self.step)
            except InterpEngineError:
                raise
            except Exception as e:  # a raw error from inside the forward would name torch, not the op
                raise failure(op, e) from e
        if address in self.deltas:
            x = x + self.deltas[address]
        if address in self.reads:
            seen = present(x) if present is not None else x
            self.records.setdefault(address, []).append(seen.detach())
        return x


class AttentionSite:
    """Handed to our attention function through the attention module's kwargs, for one layer."""

    def __init__(self, run: Run, layer: int):
        self.run, self.layer = run, layer

    def _kv(self, name: str, t: Tensor, q_len: int) -> Tensor:
        address = Address(name, self.layer)
        if not self.run.wants(address):
            return t
        current = rearrange(t[:, :, -q_len:], _TO_POINT)
        edited = self.run.touch(address, current)
        if edited is current:
            return t
        edited = rearrange(edited, _TO_HF)
        if self.run.step.kv_in_place:  # t is the KV cache's own tensor: later steps must see the edit
            t[:, :, -q_len:] = edited
            return t
        return torch.cat([t[:, :, :-q_len], edited], dim=2) if t.shape[2] > q_len else edited

    def attend(self, base, module, query, key, value, attention_mask, **kwargs):
        run, layer = self.run, self.layer
        q_address = Address("q", layer)
        if run.wants(q_address):
            query = rearrange(run.touch(q_address, rearrange(query, _TO_POINT)), _TO_HF)
        key = self._kv("k", key, query.shape[2])
        value = self._kv("v", value, query.shape[2])
        scores, probs = Address("attn_scores", layer), Address("attn_probs", layer)
        if run.wants(scores) or run.wants(probs):
            out, weights = eager_pattern(
                query, key, value, attention_mask, scaling=kwargs.get("scaling"), softcap=kwargs.get("softcap"),
                touch_scores=lambda s, present: run.touch(scores, s, present),
                touch_probs=lambda p: run.touch(probs, p),
            )
        else:
            out, weights = base(module, query, key, value, attention_mask, **kwargs)
        return run.touch(Address("z", layer), out), weights


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _with_first(value, x):
    return (x, *value[1:]) if isinstance(value, tuple) else x


@contextmanager
def installed(model: torch.nn.Module, arch: Arch, run: Run, n_layers: int) -> Iterator[None]:
    """Register exactly the hooks `run` needs; remove every one of them on the way out."""
    handles = []
    layers = model.get_submodule(arch.layers)
    try:
        for layer_index in range(n_layers):
            handles += _layer_hooks(layers[layer_index], layer_index, arch, run)
        if run.wants(FINAL):
            handles.append(model.get_submodule(arch.final_norm).register_forward_hook(
                lambda m, a, out: _with_first(out, run.touch(FINAL, _first(out)))))
        yield
    finally:
        for h in handles:
            h.remove()


def _layer_hooks(layer: torch.nn.Module, i: int, arch: Arch, run: Run) -> list:
    at = lambda point: Address(point, i)  # noqa: E731
    handles = []
    needs_mid = run.wants(at("resid_mid"))
    # Parallel blocks have no resid_mid in the forward: it is realised through attn_out (resid_pre + attn_out).
    mid_via_attn = needs_mid and arch.mid_norm is None

    if run.wants(at("resid_pre")) or mid_via_attn or (i == 0 and run.wants(EMBED)):
        def layer_in(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                x = run.touch(EMBED, x)
            x = run.touch(at("resid_pre"), x)
            if mid_via_attn:
                run.stash[i] = x
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}
        handles.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))

    if any(run.wants(at(p)) for p in ("q", "k", "v", "z", "attn_scores", "attn_probs")):
        site = AttentionSite(run, i)
        handles.append(layer.get_submodule(arch.attention).register_forward_pre_hook(
            lambda m, args, kwargs: (args, {**kwargs, SITE_KW: site}), with_kwargs=True))

    if run.wants(at("attn_out")) or mid_via_attn:
        def attn_out(module, args, out):
            a = run.touch(at("attn_out"), _first(out))
            if mid_via_attn:
                r = run.stash[i] + a
                edited = run.touch(at("resid_mid"), r)
                if edited is not r:  # realised through attn_out: the block adds exactly this to the residual
                    a = a + (edited - r)
            return _with_first(out, a)
        handles.append(layer.get_submodule(arch.attn_out).register_forward_hook(attn_out))

    if run.wants(at("mlp_act")):
        def mlp_in(module, args):
            return (run.touch(at("mlp_act"), args[0]), *args[1:])
        handles.append(layer.get_submodule(arch.mlp_down).register_forward_pre_hook(mlp_in))

    if run.wants(at("mlp_out")):
        handles.append(layer.get_submodule(arch.mlp_out).register_forward_hook(
            lambda m, a, out: _with_first(out, run.touch(at("mlp_out"), _first(out)))))

    if needs_mid and not mid_via_attn:
        handles += _mid_hooks(layer, i, arch, run)

    if run.wants(at("resid_post")):
        handles.append(layer.register_forward_hook(
            lambda m, a, out: _with_first(out, run.touch(at("resid_post"), _first(out)))))
    return handles


def _mid_hooks(layer: torch.nn.Module, i: int, arch: Arch, run: Run) -> list:
    """resid_mid of a sequential block, read at the input of the MLP's norm. HF adds it to the MLP's output from a
    local variable no hook reaches, so an edit is carried to the block's output by redoing that one addition
    with the edited value: exact, where shifting attn_out by (edited - r) would leave rounding that a norm of
    a zeroed stream scales up a thousandfold."""
    at = Address("resid_mid", i)
    edited: dict[str, Tensor] = {}

    def mid_in(module, args):
        r = args[0]
        x = run.touch(at, r)
        edited.clear()
        if x is r:
            return None
        edited["mid"] = x
        return (x, *args[1:])

    def mlp_out(module, args, out):
        if edited:
            edited["mlp"] = _first(out)

    def block_out(module, args, out):
        if not edited:
            return None
        return _with_first(out, edited.pop("mid") + edited.pop("mlp"))

    return [layer.get_submodule(arch.mid_norm).register_forward_pre_hook(mid_in),
            layer.get_submodule(arch.mlp_out).register_forward_hook(mlp_out),
            layer.register_forward_hook(block_out)]
