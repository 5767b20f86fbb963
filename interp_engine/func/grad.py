from collections.abc import Callable, Sequence
from dataclasses import dataclass

from beartype import beartype
from jaxtyping import jaxtyped
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.errors import BackendError, SpecError, fix
from interp_engine.func._prepare import checked_arguments, prepare, require_points
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.sae import Features, flat
from interp_engine.spec import Op, Spec
from interp_engine.typing import Scalar
from interp_engine.validate import feature_shape


@dataclass(frozen=True, slots=True)
class Gradients:
    """`value` is loss(logits); `grads[address]` is d value / d activation, shaped like the activation."""

    value: Scalar
    grads: Cache


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def run_with_grad(model: ModelHandle, tokens: PromptsLike, spec: Spec | Op | Sequence[Op] | None = None, *,
                  loss: Callable[[Tensor], Tensor],
                  wrt: Sequence[str | Address | Features] | str | Address | Features) -> Gradients:
    """Value and gradients of `loss(logits)` with respect to the activations at `wrt` (after the spec's edits).
    `sae.features` in `wrt`: the gradient with respect to the SAE's feature activations, the point being their
    reconstruction plus an error term held constant (`grads[sae.features]`, batch pos d_sae).

    Taken with torch.func as gradients w.r.t. zero deltas added at those points; parameters stay frozen.
    Needs a model loaded with requires_grad=True. Padded positions of `logits` are zeros.
    """
    if not model.requires_grad:
        raise BackendError(fix(f"run_with_grad needs gradients through {model.name!r}, which was loaded without them.",
                               f'load_model({model.name!r}, backend="eager", requires_grad=True).'))
    if not callable(loss):
        raise SpecError(fix("loss must be a function logits -> scalar tensor.", "loss=lambda logits: logits[0, -1, 7]"))
    require_points(wrt, "run_with_grad", "wrt")
    wanted = [wrt] if isinstance(wrt, str | Address | Features) else list(wrt)
    features = [w for w in wanted if isinstance(w, Features)]
    sparse = [str(f) for f in features if f.top_k is not None]
    if sparse:
        raise SpecError(fix(f"gradients with respect to {', '.join(sparse)}: a top-k read is a selection, which "
                            "has no gradient of its own.", "take wrt=[sae.features] and index the gradient with "
                            "the indices a capture of sae.top_features(k) returns."))
    scaled = [str(f) for f in features if f.sae.normalize != "none"]
    if scaled:
        raise SpecError(fix(f"gradients with respect to {', '.join(scaled)}: its input normalisation depends on "
                            "the activation, so the features' gradient is not the point's through W_dec alone.",
                            "fold the normalisation into the weights (SAELens: fold_activation_norm_scaling_factor), "
                            "or take wrt=[sae.reads] and apply the chain rule yourself."))
    prompts, plan = prepare(model, tokens, spec, wanted, purpose="forward", verb="run_with_grad")
    # A read-only point is a copy the forward never reads back: its gradient would be zeros, not an answer.
    derived = [str(w) for w in wanted if not isinstance(w, Features) and Address.parse(w).info.read_only]
    if derived:
        raise SpecError(fix(f"gradients with respect to {', '.join(derived)}: read-only points are derived copies "
                            "that the forward never reads back, so their gradient would be zeros.",
                            "take wrt= the point they are derived from (attn_result: z; mlp_pre, mlp_pre_linear: "
                            "mlp_act; expert_*: router_logits or mlp_out)."))
    addresses = sorted({(w.sae.reads if isinstance(w, Features) else Address.parse(w)).resolve(model.n_layers)
                        for w in wanted})
    width = max(prompts.lengths)
    shapes = {}
    for a in addresses:
        feat = feature_shape(a, model.dims, width)
        shapes[a] = (len(prompts), *feat[:1], width, *feat[1:]) if a.info.pos_axis == 2 else (len(prompts), width, *feat)
    model.runtime.load()  # here, not lazily inside torch.func's transform (loading calls requires_grad_)
    value, grads = model.runtime.forward_with_grad(prompts, plan, loss=_scalar(loss), wrt=tuple(addresses),
                                                   shapes=shapes)
    if features:
        asked = {Address.parse(w).resolve(model.n_layers) for w in wanted if not isinstance(w, Features)}
        points = grads
        grads = {a: g for a, g in points.items() if a in asked}
        for f in features:  # d loss / d f = (d loss / d x) W_dec^T: x = f W_dec + b_dec + error
            g = flat(points[f.sae.reads.resolve(model.n_layers)])
            grads[f] = g.to(f.sae.W_dec.tensor.dtype) @ f.sae.W_dec.tensor.to(g.device).T
    return Gradients(value=value, grads=Cache(grads, prompts.lengths, model.n_layers, model.name))


def _scalar(loss: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def checked(logits: Tensor) -> Tensor:
        value = loss(logits)
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise SpecError(fix(f"loss returned {shape}; gradients need a scalar.", "reduce it, e.g. .sum() or .mean()."))
        return value.reshape(())
    return checked
