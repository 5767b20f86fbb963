"""One call's hooks: where each point is read and written on a HF model, installed and removed per call.

A `Run` holds the call's ops per address, the addresses to record, optional zero deltas (for gradients) and
what was recorded. `installed()` registers only the hooks the run needs and removes them in `finally`.
"""

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.arch import LINEAR_POINTS, Arch, Dims
from interp_engine.arch.routing import dense_weights, route
from interp_engine.backends.eager.attention import SITE_KW, eager_pattern
from interp_engine.backends.eager.linear_attention import LinearSite
from interp_engine.edits import Step, apply, failure
from interp_engine.errors import InterpEngineError
from interp_engine.weights import Weights

EMBED, FINAL = Address("embed"), Address("final")


def _swap(t: Tensor) -> Tensor:
    """HF attention holds q, k, v head-major; our points present them position-major (typing.Heads / KVHeads).
    The same view both ways; a plain transpose, as einops would make it, without its per-call parsing."""
    return t.transpose(1, 2)


@functools.cache
def _at(point: str, layer: int | None) -> Address:
    # Hooks are installed per call for every layer; an Address validates itself when built, so build each once.
    return Address(point, layer)


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
        self.wanted = frozenset(ops) | reads | frozenset(self.deltas)
        # Layers with nothing to read, edit or differentiate get no hook at all.
        self.layers = frozenset(a.layer for a in self.wanted if a.layer is not None)

    def wants(self, address: Address) -> bool:
        return address in self.wanted

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

    def __init__(self, run: Run, layer: int, w_o: Callable[[], Tensor] | None = None):
        self.run, self.layer, self.w_o = run, layer, w_o
        # Gemma 4: the dict later KV-shared layers read this layer's keys and values from (None: none do).
        self.shares: dict | None = None
        self.q, self.k, self.v, self.z, self.scores, self.probs, self.result = (
            _at(p, layer) for p in ("q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result"))

    def _kv(self, address: Address, t: Tensor, q_len: int) -> Tensor:
        if not self.run.wants(address):
            return t
        current = _swap(t[:, :, -q_len:])
        edited = self.run.touch(address, current)
        if edited is current:
            return t
        edited = _swap(edited)
        if self.run.step.kv_in_place:  # t is the KV cache's own tensor: later steps must see the edit
            t[:, :, -q_len:] = edited
            return t
        return torch.cat([t[:, :, :-q_len], edited], dim=2) if t.shape[2] > q_len else edited

    def attend(self, base, module, query, key, value, attention_mask, **kwargs):
        run = self.run
        if run.wants(self.q):
            query = _swap(run.touch(self.q, _swap(query)))
        stored = key, value
        key = self._kv(self.k, key, query.shape[2])
        value = self._kv(self.v, value, query.shape[2])
        if self.shares is not None and (key is not stored[0] or value is not stored[1]):
            # HF stored the unedited pair before calling us; the sharing layers attend over the edited one (as
            # they do on vLLM, whose shared KV cache is written after our edit).
            self.shares[module.layer_type] = key, value
        scores, probs = self.scores, self.probs
        if run.wants(scores) or run.wants(probs):
            out, weights = eager_pattern(
                query, key, value, attention_mask, scaling=kwargs.get("scaling"), softcap=kwargs.get("softcap"),
                touch_scores=lambda s, present: run.touch(scores, s, present),
                touch_probs=lambda p: run.touch(probs, p), sinks=kwargs.get("s_aux"),
            )
        else:
            out, weights = base(module, query, key, value, attention_mask, **kwargs)
        z = run.touch(self.z, out)
        if run.wants(self.result):  # each head's z through its own rows of W_O [n_heads, d_head, d_model]
            w_o = self.w_o().reshape(*z.shape[2:], -1)
            run.touch(self.result, torch.einsum("bphd,hdm->bphm", z.to(w_o.dtype), w_o))
        return z, weights


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _with_first(value, x):
    return (x, *value[1:]) if isinstance(value, tuple) else x


@dataclass(frozen=True, slots=True)
class Block:
    """The modules of one decoder layer that hooks go on."""

    layer: torch.nn.Module
    # None where the arch does not serve those points (validation refuses them first).
    attention: torch.nn.Module | None
    attn_out: torch.nn.Module | None
    mlp_down: torch.nn.Module | None  # None also: a sparse MLP (no mlp_act)
    mlp_out: torch.nn.Module | None
    mid_norm: torch.nn.Module | None  # None also: a parallel block, whose resid_mid is realised through attn_out
    router: "Router | None" = None
    mlp_pre: torch.nn.Module | None = None  # its output is mlp_pre (the first half of it: Arch.mlp_pre_half)
    mlp_up: torch.nn.Module | None = None  # its output is mlp_pre_linear (the second half: Arch.mlp_pre_half)
    mlp_pre_half: bool = False
    kv_latent: torch.nn.Module | None = None  # its output is kv_latent (multi-head latent attention)
    linear: torch.nn.Module | None = None  # a linear-attention layer's Gated DeltaNet (arch.linear_attention)
    lin_rep: int = 1  # value heads per key head there
    mlp_tail: bool = False  # Arch.mlp_tail: resid_mid is written through attn_out
    kv_shares: str | None = None  # Arch.kv_shares: the attention kwarg holding the keys later layers reuse
    o_proj: torch.nn.Module | None = None  # Arch.o_proj: W_O read from the layer itself (no TL-shaped weights)


@dataclass(frozen=True, slots=True)
class Router:
    """A sparse MLP's gate, and how the experts choose from its logits (to choose again after an edit)."""

    gate: torch.nn.Module
    routing: tuple  # route()'s arguments after the logits
    experts: torch.nn.Module  # forward(rows, top-k ids, top-k weights) -> the weighted sum


@dataclass(frozen=True, slots=True)
class Layout:
    """Where an Arch's points sit in one loaded model. Looked up once at load: walking the dotted module paths
    for every layer on every call cost more than installing the hooks themselves."""

    blocks: tuple[Block, ...]
    final_norm: torch.nn.Module
    # The model's TransformerLens-shaped weights, read when first asked (attn_result needs W_O).
    weights: "Callable[[], Weights] | None" = None

    @classmethod
    def of(cls, model: torch.nn.Module, arch: Arch, dims: Dims,
           weights: "Callable[[], Weights] | None" = None) -> "Layout":
        layers = model.get_submodule(arch.layers)

        def at(layer, path):
            return layer.get_submodule(path) if path is not None else None

        moe, config = arch.moe, model.config

        def block(i: int) -> Block:
            layer, kinds = layers[i], dims.layer_kinds[i] if dims.layer_kinds else ()
            # A dense layer of a mixture-of-experts model has no router; an MoE layer no dense MLP (Gemma 4's has).
            sparse = moe is not None and "dense" not in kinds
            dense = moe is None or "dense" in kinds or moe.dense_mlp
            gate = layer.get_submodule(moe.router) if sparse else None
            router = Router(gate, moe.routing(config, gate, layer), layer.get_submodule(moe.experts)) if sparse else None
            mlp = (lambda p: at(layer, p)) if dense else (lambda p: None)
            # A linear-attention layer has no softmax attention; its Gated DeltaNet's output is attn_out.
            linear = at(layer, arch.linear_attention) if "linear_attention" in kinds else None
            return Block(layer, None if linear else at(layer, arch.attention), linear or at(layer, arch.attn_out),
                         mlp(arch.mlp_down), at(layer, arch.mlp_out), at(layer, arch.mid_norm), router,
                         mlp(arch.mlp_pre), mlp(arch.mlp_up), arch.mlp_pre_half, at(layer, arch.kv_latent), linear,
                         dims.n_lin_v_heads // (dims.n_lin_k_heads or 1), arch.mlp_tail, arch.kv_shares,
                         at(layer, arch.o_proj))

        return cls(tuple(block(i) for i in range(dims.n_layers)), model.get_submodule(arch.final_norm), weights)


@contextmanager
def installed(layout: Layout, run: Run) -> Iterator[None]:
    """Register exactly the hooks `run` needs; remove every one of them on the way out."""
    handles = []
    try:
        for i, block in enumerate(layout.blocks):
            if i in run.layers or (i == 0 and run.wants(EMBED)):
                handles += _layer_hooks(block, i, run, layout.weights)
        if run.wants(FINAL):
            handles.append(layout.final_norm.register_forward_hook(
                lambda m, a, out: _with_first(out, run.touch(FINAL, _first(out)))))
        yield
    finally:
        for h in handles:
            h.remove()


def _layer_hooks(block: Block, i: int, run: Run, weights: "Callable[[], Weights] | None") -> list:
    layer = block.layer
    resid_pre, attn_out_at, resid_mid, mlp_act, mlp_out_at, resid_post = (
        _at(p, i) for p in ("resid_pre", "attn_out", "resid_mid", "mlp_act", "mlp_out", "resid_post"))
    handles = []
    needs_mid = run.wants(resid_mid)
    # Parallel blocks have no resid_mid in the forward: it is realised through attn_out (resid_pre + attn_out); so
    # is it where the block does more after the MLP's residual add than a hook could redo (Arch.mlp_tail).
    mid_via_attn = needs_mid and (block.mid_norm is None or block.mlp_tail)

    if run.wants(resid_pre) or mid_via_attn or (i == 0 and run.wants(EMBED)):
        def layer_in(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            if i == 0:
                x = run.touch(EMBED, x)
            x = run.touch(resid_pre, x)
            if mid_via_attn:
                run.stash[i] = x
            if args:
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}
        handles.append(layer.register_forward_pre_hook(layer_in, with_kwargs=True))

    if run.wants(latent := _at("kv_latent", i)):
        handles.append(block.kv_latent.register_forward_hook(lambda m, a, out: run.touch(latent, out)))

    if any(run.wants(_at(p, i)) for p in ("q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result")):
        o = block.o_proj  # its weight [d_model, n_heads * d_head] transposed: W_O with the heads not yet split
        site = AttentionSite(run, i, (lambda: o.weight.detach().T) if o is not None
                             else weights and (lambda: weights().layers[i].W_O))

        def attention_in(module, args, kwargs):
            if block.kv_shares is not None and getattr(module, "store_full_length_kv", False):
                site.shares = kwargs.get(block.kv_shares)
            return args, {**kwargs, SITE_KW: site}
        handles.append(block.attention.register_forward_pre_hook(attention_in, with_kwargs=True))

    if any(run.wants(_at(p, i)) for p in LINEAR_POINTS):
        site = LinearSite(run, lambda p: _at(p, i), block.lin_rep)
        handles.append(block.linear.register_forward_pre_hook(site.pre_hook, with_kwargs=True))
        if run.wants(_at("lin_out", i)) or run.wants(_at("lin_z", i)):
            handles.append(block.linear.norm.register_forward_pre_hook(site.norm_hook))

    if run.wants(attn_out_at) or mid_via_attn:
        def attn_out(module, args, out):
            a = run.touch(attn_out_at, _first(out))
            if mid_via_attn:
                r = run.stash[i] + a
                edited = run.touch(resid_mid, r)
                if edited is not r:  # realised through attn_out: the block adds resid_pre to what we return
                    a = _through(run.stash[i], a, r, edited)
            return _with_first(out, a)
        handles.append(block.attn_out.register_forward_hook(attn_out))

    handles += _mlp_pre_hooks(block, i, run)

    if run.wants(mlp_act):
        def mlp_in(module, args):
            return (run.touch(mlp_act, args[0]), *args[1:])
        handles.append(block.mlp_down.register_forward_pre_hook(mlp_in))

    if run.wants(mlp_out_at):
        handles.append(block.mlp_out.register_forward_hook(
            lambda m, a, out: _with_first(out, run.touch(mlp_out_at, _first(out)))))

    if needs_mid and not mid_via_attn:
        handles += _mid_hooks(block, i, run)

    if any(run.wants(_at(p, i)) for p in ("router_logits", "expert_weights", "expert_out")):
        handles += _router_hooks(block, i, run)

    if run.wants(resid_post):
        handles.append(layer.register_forward_hook(
            lambda m, a, out: _with_first(out, run.touch(resid_post, _first(out)))))
    return handles


def _through(pre: Tensor, a: Tensor, r: Tensor, edited: Tensor) -> Tensor:
    """What attention must add to `pre` for the block's resid_mid to be `edited` (r = pre + a, unedited). Shifting a
    by (edited - r) keeps a small edit exact (a zero one bit for bit); edited - pre a large one (a zeroed stream
    exactly 0, which the MLP's norm would otherwise scale up from rounding): each element takes the one whose sum
    with pre is exact."""
    shifted = a + (edited - r)
    return torch.where(pre + shifted == edited, shifted, edited - pre)


def _mlp_pre_hooks(block: Block, i: int, run: Run) -> list:
    """mlp_pre and mlp_pre_linear, read (never written) at the input projections' outputs; a fused gate_up
    projection holds both, gate first."""
    handles = []
    for half, (at, module) in enumerate(((_at("mlp_pre", i), block.mlp_pre), (_at("mlp_pre_linear", i), block.mlp_up))):
        if run.wants(at):
            def out_hook(m, args, out, at=at, half=half):
                run.touch(at, out.chunk(2, dim=-1)[half] if block.mlp_pre_half else out)
            handles.append(module.register_forward_hook(out_hook))
    return handles


def _mid_hooks(block: Block, i: int, run: Run) -> list:
    """resid_mid of a sequential block, read at the input of the MLP's norm. HF adds it to the MLP's output from a
    local variable no hook reaches, so an edit is carried to the block's output by redoing that one addition
    with the edited value: exact, where shifting attn_out by (edited - r) would leave rounding that a norm of
    a zeroed stream scales up a thousandfold."""
    at = _at("resid_mid", i)
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

    return [block.mid_norm.register_forward_pre_hook(mid_in),
            block.mlp_out.register_forward_hook(mlp_out),
            block.layer.register_forward_hook(block_out)]


def _router_hooks(block: Block, i: int, run: Run) -> list:
    """router_logits and expert_weights, at the gate's output: most HF routers return (logits, weights, indices)
    computed from the logits inside one forward, so an edit chooses again from the edited logits, as the router
    would have; Gemma 4's gate (its router's projection) returns the logits alone, and its router chooses from what
    the hook returns. expert_out at the experts' input: each of the k chosen experts run alone with weight 1 (the
    experts module's own forward, k more times), in the router's top-k order."""
    at, weights_at, out_at, router = _at("router_logits", i), _at("expert_weights", i), _at("expert_out", i), block.router
    shape: list = []

    def layer_in(module, args, kwargs):  # the gate sees the rows flat; the point is [batch, pos, n_experts]
        shape[:] = (args[0] if args else kwargs["hidden_states"]).shape[:-1]

    def gate_out(module, args, out):
        logits = _first(out)
        x = logits.view(*shape, logits.shape[-1])
        edited = run.touch(at, x)
        flat = edited.reshape(logits.shape)
        alone = not isinstance(out, tuple)  # the logits alone: the router chooses from what this hook returns
        if run.wants(weights_at) or (edited is not x and not alone):
            chosen = tuple(out[1:]) if edited is x and not alone else route(flat, *router.routing)
        if run.wants(weights_at):
            run.touch(weights_at, dense_weights(*chosen, logits.shape[-1]).to(x.dtype).view(x.shape))
        if edited is x:
            return None
        return flat if alone else (flat, *chosen)

    def experts_in(module, args):
        # Highest weight first: the top-k order of the softmax routers; DeepSeek's returns its choice unsorted.
        rows, chosen = args[0], args[1].gather(-1, args[2].argsort(dim=-1, descending=True, stable=True))
        ones = torch.ones_like(chosen[:, :1], dtype=rows.dtype)
        each = [module.forward(rows, chosen[:, j:j + 1], ones) for j in range(chosen.shape[-1])]
        run.touch(out_at, torch.stack(each, dim=1).view(*shape, chosen.shape[-1], rows.shape[-1]))

    handles = [block.layer.register_forward_pre_hook(layer_in, with_kwargs=True)]
    if run.wants(at) or run.wants(weights_at):
        handles.append(router.gate.register_forward_hook(gate_out))
    if run.wants(out_at):
        handles.append(router.experts.register_forward_pre_hook(experts_in))
    return handles
