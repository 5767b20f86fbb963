"""One call's hooks: where each point is read and written on a HF model (`layout.py` says which modules),
installed and removed per call. `installed()` registers only the hooks the call's `Run` (`run.py`) needs and
removes them in `finally`.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.arch import LINEAR_POINTS
from interp_engine.arch.routing import dense_weights, route
from interp_engine.backends.eager.attention import SITE_KW, AttentionSite
from interp_engine.backends.eager.layout import Block, Layout
from interp_engine.backends.eager.linear_attention import LinearSite
from interp_engine.backends.eager.run import Run, at as _at
from interp_engine.edits import shift_addend
from interp_engine.weights import Weights

EMBED, FINAL = Address("embed"), Address("final")


def _first(value):
    return value[0] if isinstance(value, tuple) else value


def _with_first(value, x):
    return (x, *value[1:]) if isinstance(value, tuple) else x


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
                    a = shift_addend(run.stash[i], a, r, edited)
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
