"""The vLLM site table: where each point is in vLLM's model, and how a hook there reads and replaces it.

Written once for both vLLM backends. A family's module paths are its `VllmLayout` (its arch file); the table
below says, per site, which layout field names the module, whether the hook runs before (pre) or after (post)
it, how the point's tensors are unpacked from the hook's arguments and packed back (the codec), and which
points those tensors are. `register` turns a site and a transform (tensors -> tensors) into a hook:

- `vllm` (worker.py): the transform gathers tensor-parallel shards, runs each call's ops on its rows, records
  reads, and splits edits back (Python, per request);
- `vllm-static` (static.py): the transform is the tap bodies, tensor ops only, traced into the compiled graph.

A transform returns its inputs unchanged (the same objects) when it edits nothing; the hook then returns None
and the model goes on with its own tensors. Codec bodies are tensor-only too (they are traced).

vLLM carries the residual stream as (hidden, residual) and adds the two first thing in the next fused
add-norm; a site that edits the stream hands it on as (x, 0), which stays exactly x through the add.
"""

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat_modules
from interp_engine.arch.discover import has_module
from interp_engine.edits import shift_addend

EMBED, FINAL, LOGITS = Address("embed"), Address("final"), Address("logits")

Tensors = tuple[torch.Tensor, ...]


@dataclass(frozen=True, slots=True)
class Codec:
    """How one kind of hook finds its tensors and hands edited ones on. `unpack(args, kwargs, out)` and
    `repack(args, kwargs, out, new)` see the hook's arguments (`out` is None in a pre-hook, `kwargs` empty
    unless `kwargs` is True); repack returns what the hook returns."""

    name: str
    unpack: Callable[..., Tensors]
    repack: Callable[..., object]
    kwargs: bool = False  # a pre-hook registered with_kwargs
    fresh: bool = False  # unpacks a new tensor (a sum), which the model never sees unless edited: read uncopied
    module: bool = False  # unpack and repack take the hooked module first (they read its weights)


_NAMES = ("positions", "hidden_states", "residual")
# GPT-OSS's TransformerBlock takes (hidden_states, positions, residual): told apart by the first argument's dtype
# (positions are integers, the stream never is).
_HIDDEN_FIRST = ("hidden_states", "positions", "residual")


def _order(args) -> tuple[str, ...]:
    return _HIDDEN_FIRST if args and args[0].is_floating_point() else _NAMES


def _layer_args(args, kwargs):
    names = _order(args)
    values = dict(zip(names, args)) | {n: kwargs.get(n) for n in names[len(args):]}
    if values["positions"] is None and kwargs.get("position_ids") is not None:  # an HF layer (batched)
        values["positions"] = kwargs["position_ids"].flatten()
    return values["positions"], values["hidden_states"], values["residual"]


def layer_positions(args, kwargs):
    """A decoder layer's absolute positions, from its pre-hook's arguments."""
    return _layer_args(args, kwargs)[0]


def _stream_in(args, kwargs, out):
    _, hidden, residual = _layer_args(args, kwargs)
    return (hidden if residual is None else hidden + residual,)


def _stream_in_repack(args, kwargs, out, new):
    _, _, residual = _layer_args(args, kwargs)
    # A layer that takes no residual (its input is the stream itself) gets none.
    zero = {} if residual is None else {"residual": torch.zeros_like(residual)}
    names = _order(args)[:len(args)]
    given, kwargs = dict(zip(names, args)), dict(kwargs)
    (given if "hidden_states" in given else kwargs)["hidden_states"] = new[0]
    if "residual" in given:
        given["residual"] = zero.get("residual")
    else:
        kwargs.update(zero)
    return (*(given[n] for n in names), *args[3:]), kwargs


# The decoder layer's input, forward(positions, hidden, residual): the stream is hidden + residual.
STREAM_IN = Codec("stream_in", _stream_in, _stream_in_repack, kwargs=True)
# A fused add-norm's input, norm(x, residual): it adds them first thing.
FUSED_IN = Codec("fused_in", lambda args, kwargs, out: (args[0] + args[1],),
                 lambda args, kwargs, out, new: (new[0], torch.zeros_like(args[1]), *args[2:]), fresh=True)
# A plain norm's input that is also the stream its layer adds the block's output to (a layer that returns the
# stream itself, Gemma 4's: no fused add-norm hands the residual on), so a write goes into that tensor in place
# and reaches both.
STREAM_SHARED = Codec("stream_shared", lambda args, kwargs, out: (args[0],),
                      lambda args, kwargs, out, new: (args[0].copy_(new[0]), *args[1:]))
# The decoder layer's output, (hidden, residual): the stream is their sum.
STREAM_OUT = Codec("stream_out", lambda args, kwargs, out: (out[0] + out[1],),
                   lambda args, kwargs, out, new: (new[0], torch.zeros_like(out[1])), fresh=True)
# A module's first input (o_proj's is z, down_proj's is mlp_act).
INPUT = Codec("input", lambda args, kwargs, out: (args[0],),
              lambda args, kwargs, out, new: (new[0], *args[1:]))
# A module's output.
OUTPUT = Codec("output", lambda args, kwargs, out: (out,), lambda args, kwargs, out, new: new[0])
# A module's output, or the first of its outputs (the final norm returns (normed, residual) when fused).
FIRST_OUTPUT = Codec("first_output",
                     lambda args, kwargs, out: (out[0] if isinstance(out, tuple) else out,),
                     lambda args, kwargs, out, new: (new[0], *out[1:]) if isinstance(out, tuple) else new[0])
# A merged gate_up projection's output, (gate_up, bias): this rank's [gate; up] halves are mlp_pre and mlp_pre_linear.
GATE_UP = Codec("gate_up", lambda args, kwargs, out: tuple(out[0].chunk(2, dim=-1)),
                lambda args, kwargs, out, new: (torch.cat(new, dim=-1), *out[1:]))
# Attention's input, forward(q, k, v, ...) after rotary, each [rows, local heads * d_head].
QKV = Codec("qkv", lambda args, kwargs, out: tuple(args[:3]), lambda args, kwargs, out, new: (*new, *args[3:]))

# Latent attention's MLA attention (DeepSeek), forward(q, latent, k_pe) after rotary: q [rows, local heads,
# qk_head_dim], the latent after its norm, the shared rotary key [rows, 1, qk_rope_head_dim]. q, k and v are
# unpacked as eager defines them: k and v are the latent expanded by kv_b_proj, as vLLM's own prefill does, with
# the shared key part on every head's k. vLLM's DeepSeek rotary pairs neighbouring dimensions (x0, x1), (x2, x3),
# ... in place; HF's lays the rotated pairs out as the evens then the odds: the rotary parts are permuted to HF's
# layout here (a permutation of both q and k, so q.k is unchanged) and q's back on repack. Only q goes back: the
# kernel expands k and v from the latent itself (their writes are refused before any request).
def _to_hf(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _from_hf(x: torch.Tensor) -> torch.Tensor:
    return torch.stack(x.chunk(2, dim=-1), dim=-1).flatten(-2)


def _latent_unpack(mla, args, kwargs, out):
    q, latent, k_pe = args[:3]
    nope = q.shape[-1] - k_pe.shape[-1]
    k_nope, v = compat_modules.expand_latent(mla, latent)
    k = torch.cat((k_nope, _to_hf(k_pe).expand(-1, k_nope.shape[1], -1)), dim=-1)
    return torch.cat((q[..., :nope], _to_hf(q[..., nope:])), dim=-1), k, v


def _latent_repack(mla, args, kwargs, out, new):
    q, k_pe = new[0].view(args[0].shape), args[2]
    nope = q.shape[-1] - k_pe.shape[-1]
    return (torch.cat((q[..., :nope], _from_hf(q[..., nope:])), dim=-1), *args[1:])


LATENT_QKV = Codec("latent_qkv", _latent_unpack, _latent_repack, fresh=True, module=True)
# A Gated DeltaNet's gated norm, norm(out, z), each [rows, local value heads, d_lin_v].
GATED_NORM = Codec("gated_norm", lambda args, kwargs, out: tuple(args[:2]),
                   lambda args, kwargs, out, new: (*new, *args[2:]))


# A Gated DeltaNet's gates, recomputed at its input as eager defines them (arch/qwen3_next.py): beta = sigmoid(b) in
# the model's dtype, g = -exp(A_log) * softplus(a + dt_bias) in float32, each [rows, local value heads], from the b
# and a its forward projects and hands to the custom op. Read only (VllmLayout.read_only): never repacked.
def _gates_unpack(gdn, args, kwargs, out):
    b, a = compat_modules.gdn_gate_inputs(gdn, args[0] if args else kwargs["hidden_states"])
    a_log, dt_bias = compat_modules.gdn_decay(gdn)
    return b.sigmoid(), -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)


def _gates_repack(gdn, args, kwargs, out, new):
    raise RuntimeError("internal: lin_beta and lin_g are read only on the vLLM backends (VllmLayout.read_only)")


LIN_GATES = Codec("lin_gates", _gates_unpack, _gates_repack, kwargs=True, fresh=True, module=True)
FLOAT32 = ("lin_g",)  # points read in float32 whatever the model's dtype, as eager computes them


@dataclass(frozen=True, slots=True)
class Site:
    """One hook: on the module named by layout field `module` ("" = the decoder layer itself; relative to the
    model when `scope` is "model"), before or after it, unpacked by `codec` into one tensor per point in
    `points`. A point may be a chain read in order on the same tensor ("embed>resid_pre": layer 0's input is
    the embedding, then resid_pre.0)."""

    module: str
    hook: Literal["pre", "post"]
    codec: Codec
    points: tuple[str, ...]
    scope: Literal["layer", "model"] = "layer"

    def addresses(self, layer: int | None) -> tuple[tuple[Address, ...], ...]:
        """Per unpacked tensor, the addresses read and edited on it, in order."""
        return _addresses(self, layer)


@functools.cache  # hooks are installed per call, ~10 sites per layer: a few hundred checked Addresses a call
def _addresses(site: Site, layer: int | None) -> tuple[tuple[Address, ...], ...]:
    return tuple(tuple(_address(p, layer) for p in chain.split(">") if _address(p, layer) is not None)
                 for chain in site.points)


def _address(point: str, layer: int | None) -> Address | None:
    if point == "embed":
        return EMBED if layer == 0 else None
    if point == "final":
        return FINAL
    return Address(point, layer)


# The sites, in the order their hooks run within a layer. Module names are `VllmLayout` fields.
SITES = (
    Site("", "pre", STREAM_IN, ("embed>resid_pre",)),
    # Latent attention's KV norm (DeepSeek): its output is the latent the cache stores and every head reads.
    Site("kv_latent", "post", OUTPUT, ("kv_latent",)),
    Site("attention", "pre", QKV, ("q", "k", "v")),
    Site("mla", "pre", LATENT_QKV, ("q", "k", "v")),
    Site("o_proj", "pre", INPUT, ("z",)),
    Site("z_out", "post", OUTPUT, ("z",)),
    Site("attn_out", "post", OUTPUT, ("attn_out",)),
    Site("linear_attn", "pre", LIN_GATES, ("lin_beta", "lin_g")),
    Site("lin_norm", "pre", GATED_NORM, ("lin_out", "lin_z")),
    Site("linear_attn", "post", OUTPUT, ("attn_out",)),
    Site("mid_norm", "pre", FUSED_IN, ("resid_mid",)),
    Site("mlp_in", "post", GATE_UP, ("mlp_pre", "mlp_pre_linear")),
    Site("mlp_pre", "post", FIRST_OUTPUT, ("mlp_pre",)),
    Site("mlp_down", "pre", INPUT, ("mlp_act",)),
    # The MoE gate's output, (logits, bias): the experts choose from the logits it returns.
    Site("router", "post", FIRST_OUTPUT, ("router_logits",)),
    Site("mlp_out", "post", OUTPUT, ("mlp_out",)),
    Site("", "post", STREAM_OUT, ("resid_post",)),
    Site("final_norm", "post", FIRST_OUTPUT, ("final",), scope="model"),
)
LAYER_SITES = tuple(s for s in SITES if s.scope == "layer")
MODEL_SITES = tuple(s for s in SITES if s.scope == "model")
# A layer that returns the stream itself (alone, or first of a tuple): resid_post is that first output, and its
# MLP's norm takes resid_mid alone.
_FIRST_CODECS = {STREAM_OUT: FIRST_OUTPUT, FUSED_IN: STREAM_SHARED}
_FIRST_SITES = tuple(dataclasses.replace(s, codec=_FIRST_CODECS.get(s.codec, s.codec)) for s in LAYER_SITES)




def _batched(codec: Codec) -> Codec:
    """`codec` on HF modules run by vLLM's Transformers backend: every tensor but attention's q, k, v is
    [1, tokens, ...] (a batch of one), unpacked as [tokens, ...] and packed back with the batch axis."""
    return dataclasses.replace(
        codec, name=f"batched_{codec.name}",
        unpack=lambda *a: tuple(x[0] for x in codec.unpack(*a)),
        repack=lambda *a: codec.repack(*a[:-1], tuple(y.unsqueeze(0) for y in a[-1])))


# Its projections return the tensor alone (return_bias=False): the merged gate_up's output is [gate; up] itself.
_GATE_UP_ALONE = Codec("gate_up_alone", lambda args, kwargs, out: tuple(out.chunk(2, dim=-1)),
                       lambda args, kwargs, out, new: torch.cat(new, dim=-1))
# Its layers take and return the stream alone, and no norm adds a residual: the MLP's input is resid_mid and
# also the tensor its layer adds the MLP's output to (written in place, as STREAM_SHARED).
_BATCHED_CODECS = {c: _batched(c) for c in (STREAM_IN, INPUT, OUTPUT, FIRST_OUTPUT, STREAM_SHARED)} | {
    STREAM_OUT: _batched(FIRST_OUTPUT), FUSED_IN: _batched(STREAM_SHARED), GATE_UP: _batched(_GATE_UP_ALONE)}
_BATCHED_SITES = tuple(dataclasses.replace(s, codec=_BATCHED_CODECS.get(s.codec, s.codec)) for s in SITES)


def layer_sites(layout) -> tuple[Site, ...]:
    """The layer sites for a layout's convention of what a layer returns (`VllmLayout.stream_out`)."""
    if layout.stream_out == "batched":
        return tuple(s for s in _BATCHED_SITES if s.scope == "layer")
    return _FIRST_SITES if layout.stream_out == "first" else LAYER_SITES


def model_sites(layout) -> tuple[Site, ...]:
    """The model-wide sites (the final norm) for a layout's convention."""
    return tuple(s for s in _BATCHED_SITES if s.scope == "model") if layout.stream_out == "batched" else MODEL_SITES


def module_of(site: Site, layout, root):
    """The module a site hooks: `root` is a decoder layer (layer sites) or the model (model sites). None where the
    layout has no such module, or this layer has not (a hybrid's layer has attention or a Gated DeltaNet)."""
    return module_at(layout, site.module, root) if site.module else root


def module_at(layout, field: str, root):
    """The module `layout.<field>` names under `root`; None as in `module_of`."""
    path = getattr(layout, field)
    # Only a hybrid's layers differ: elsewhere a missing module is a wrong table, and get_submodule says so.
    if path is None or (layout.linear_attn is not None and not has_module(root, path)):
        return None
    return root.get_submodule(path)


def register(module, site: Site, transform: Callable[[Tensors], Tensors], when: Callable[[], bool] | None = None):
    """Hook `transform` onto `module` at `site`; its handle. With `when`, the hook does nothing (not even
    unpack) in a forward where `when()` is false (Python: never for a traced tap)."""
    codec = site.codec
    own = (module,) if codec.module else ()

    def apply(args, kwargs, out):
        if when is not None and not when():
            return None
        xs = codec.unpack(*own, args, kwargs, out)
        ys = transform(xs)
        if all(a is b for a, b in zip(xs, ys)):
            return None
        return codec.repack(*own, args, kwargs, out, ys)

    if site.hook == "post":
        return module.register_forward_hook(lambda m, args, out: apply(args, {}, out))
    if codec.kwargs:
        return module.register_forward_pre_hook(lambda m, args, kwargs: apply(args, kwargs, None), with_kwargs=True)
    return module.register_forward_pre_hook(lambda m, args: apply(args, {}, None))


def parallel_mid(layout, layer, mid: Callable[[torch.Tensor], torch.Tensor], kept: torch.Tensor | None = None,
                 when: Callable[[], bool] | None = None) -> list:
    """resid_mid of a parallel block (`VllmLayout.parallel`: attention and MLP both read resid_pre, so no module sees
    resid_pre + attn_out), formed as eager forms it: the layer's input is kept (after resid_pre's own hook, which is
    registered first), and at attn_out's output (after its own hook) their sum goes to `mid` (a transform of one
    tensor, returning it itself where nothing changed). An edit reaches resid_post through attn_out
    (`edits.shift_addend`); the MLP still reads resid_pre. `kept`: a persistent buffer for the input (a traced tap
    cannot hand a tensor from one hook to another through Python), else a list. The handles, input's first."""
    # By module: a Gated DeltaNet's output site reads attn_out too.
    sites = {(s.module, s.hook): s for s in layer_sites(layout)}
    stash: list[torch.Tensor] = []

    def keep(xs):
        if kept is None:
            stash[:] = xs[:1]
        else:
            kept[:xs[0].shape[0]].copy_(xs[0])
        return xs

    def form(xs):
        a = xs[0]
        pre = stash.pop() if kept is None else kept[:a.shape[0]]
        r = pre + a
        edited = mid(r)
        return xs if edited is r else (shift_addend(pre, a, r, edited).to(a.dtype),)

    return [register(layer, sites[("", "pre")], keep, when),
            register(module_at(layout, "attn_out", layer), sites[("attn_out", "post")], form, when)]
