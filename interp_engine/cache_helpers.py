"""TransformerLens's ActivationCache helpers over a Cache, with TL's names and meanings (cache.py delegates here).

Stacks are [components, batch, pos, d_model]. `pos_slice` (an int drops the pos axis, a slice keeps it) cuts the
positions, as in TL. Two differences from TL, both because TL folds the norms into the weights and we do not:
`apply_ln_to_stack` applies the model's real norm (its weight; Gemma's 1 + w), linearised as TL does, by dividing
every component by the scale of the whole residual; and the norm's bias (LayerNorm) is left out, since it is a
constant that belongs to no component (TL folds it into b_U). So the normed components sum to the norm's output
minus its bias, and `logit_attrs` sum to the logit difference minus that bias's and b_U's share.
"""

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.errors import PointError, SpecError, fix

PosSlice = int | slice | None


def _sliced(t: Tensor, pos_slice: PosSlice, pos_axis: int = -2) -> Tensor:
    if pos_slice is None:
        return t
    index = [slice(None)] * t.ndim
    index[pos_axis] = pos_slice
    return t[tuple(index)]


def _layer(cache, layer: int | None) -> int:
    n = cache.n_layers
    if layer is None or layer == -1:
        return n
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer <= n:
        raise PointError(fix(f"layer={layer!r}: a stack runs up to a layer in 0..{n} (or None / -1: all {n}).",
                             f"pass layer in 0..{n}, or leave it unset."))
    return layer


def _need(cache, addresses: list[Address]) -> list[Tensor]:
    missing = [str(a) for a in addresses if a not in cache.tensors]
    if missing:
        raise PointError(fix(f"this cache lacks {', '.join(missing)}, which this helper reads.",
                             f"capture them too: capture(model, tokens, {missing!r} + ...)."))
    return [cache.tensors[a] for a in addresses]


def stack_activation(cache, point: str, layer: int | None = None) -> Tensor:
    """`point` at every layer before `layer` (default: all), stacked: [layers, ...] (TL's stack_activation)."""
    layer = _layer(cache, layer)
    if layer == 0:
        raise SpecError(fix("stack_activation(layer=0) stacks the layers before layer 0: none.",
                            "pass layer >= 1, or leave it unset for every layer."))
    return torch.stack(_need(cache, [Address(point, i) for i in range(layer)]))


def accumulated_resid(cache, layer: int | None = None, *, incl_mid: bool = False, apply_ln: bool = False,
                      model=None, pos_slice: PosSlice = None, return_labels: bool = False):
    """The residual stream before each layer up to `layer` (resid_pre.0 .. resid_pre.layer; at layer=n_layers or
    None, the last is resid_post of the last layer, TL's "final_post"); `incl_mid` adds each resid_mid."""
    layer = _layer(cache, layer)
    addresses, labels = [], []
    for i in range(layer + 1):
        if i == cache.n_layers:
            addresses.append(Address("resid_post", i - 1))
            labels.append("final_post")
            continue
        addresses.append(Address("resid_pre", i))
        labels.append(f"{i}_pre")
        if incl_mid and i < layer:
            addresses.append(Address("resid_mid", i))
            labels.append(f"{i}_mid")
    stack = _sliced(torch.stack(_need(cache, addresses)), pos_slice)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, model=model, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack


def decompose_resid(cache, layer: int | None = None, *, mlp_input: bool = False, incl_embeds: bool = True,
                    apply_ln: bool = False, model=None, pos_slice: PosSlice = None, return_labels: bool = False):
    """What each block wrote into the residual stream up to `layer`: embed (which holds any learned positions:
    there is no separate pos_embed), then attn_out and mlp_out of each layer before `layer` (`mlp_input`: also
    attn_out of `layer`). They sum to resid_pre of `layer` (resid_post of the last layer at layer=None)."""
    layer = _layer(cache, layer)
    addresses, labels = ([Address("embed")], ["embed"]) if incl_embeds else ([], [])
    for i in range(layer):
        addresses += [Address("attn_out", i), Address("mlp_out", i)]
        labels += [f"{i}_attn_out", f"{i}_mlp_out"]
    if mlp_input:
        if layer == cache.n_layers:
            raise PointError(fix("mlp_input=True reads the MLP input of `layer`, and there is no layer after the last.",
                                 f"pass layer in 0..{cache.n_layers - 1}."))
        addresses.append(Address("attn_out", layer))
        labels.append(f"{layer}_attn_out")
    stack = _sliced(torch.stack(_need(cache, addresses)), pos_slice)
    if apply_ln:
        stack = apply_ln_to_stack(cache, stack, layer, mlp_input=mlp_input, model=model, pos_slice=pos_slice)
    return (stack, labels) if return_labels else stack


def apply_ln_to_stack(cache, stack: Tensor, layer: int | None = None, *, mlp_input: bool = False, model=None,
                      pos_slice: PosSlice = None) -> Tensor:
    """Each component of `stack` through the norm that reads the residual at `layer` (None / n_layers: the final
    norm; else the layer's attention norm, or its MLP norm with `mlp_input`), linearised: divided by the scale
    of the whole residual there (read from this cache), times the norm's weight, without its bias."""
    if model is None:
        raise SpecError(fix("applying a norm needs the model's norm weights.", "pass model=model."))
    layer = _layer(cache, layer)
    weights = model.weights
    if layer == cache.n_layers:
        norm, resid = weights.ln_final, Address("resid_post", layer - 1)
    else:
        block = weights.layer(layer)
        parallel = model.arch.parallel
        norm = (block.ln2 or (block.ln1 if parallel else None)) if mlp_input else block.ln1
        resid = Address("resid_mid" if mlp_input and not parallel else "resid_pre", layer)
        if norm is None:
            raise SpecError(fix(f"{model.cfg.family} has no norm before the {'MLP' if mlp_input else 'attention'} "
                                f"of layer {layer}.", "apply no norm there (apply_ln=False)."))
    scale = _sliced(norm.scale(_need(cache, [resid])[0]), pos_slice)
    return norm.linear(stack, scale.to(stack.device))


def logit_attrs(cache, stack: Tensor, tokens, incorrect_tokens=None, *, model=None,
                pos_slice: PosSlice = None) -> Tensor:
    """Direct logit attribution: each component of `stack`, through the final norm (linearised), dotted with the
    unembedding direction of `tokens` (minus that of `incorrect_tokens`). Tokens: an id, a single-token string,
    or a tensor of ids broadcasting against the stack's [batch(, pos)] axes. Returns stack.shape[:-1]."""
    if model is None:
        raise SpecError(fix("logit attribution needs the model's unembedding.", "pass model=model."))
    scaled = apply_ln_to_stack(cache, stack, None, model=model, pos_slice=pos_slice)
    direction = _directions(model, tokens)
    if incorrect_tokens is not None:
        direction = direction - _directions(model, incorrect_tokens)
    return (scaled * direction.to(scaled.device, scaled.dtype)).sum(-1)


def _directions(model, tokens) -> Tensor:
    if isinstance(tokens, str):
        tokens = model.to_single_token(tokens)
    ids = torch.as_tensor(tokens, dtype=torch.long)
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < model.d_vocab):
        raise SpecError(fix(f"token ids must lie in 0..{model.d_vocab - 1}.", "pass ids from model.to_tokens()."))
    return model.W_U[:, ids].movedim(0, -1)
