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
                  loss: Callable[[Tensor], Tensor], wrt: Sequence[str | Address] | str | Address) -> Gradients:
    """Value and gradients of `loss(logits)` with respect to the activations at `wrt` (after the spec's edits).

    Taken with torch.func as gradients w.r.t. zero deltas added at those points; parameters stay frozen.
    Needs a model loaded with requires_grad=True. Padded positions of `logits` are zeros.
    """
    if not model.requires_grad:
        raise BackendError(fix(f"run_with_grad needs gradients through {model.name!r}, which was loaded without them.",
                               f'load_model({model.name!r}, backend="eager", requires_grad=True).'))
    if not callable(loss):
        raise SpecError(fix("loss must be a function logits -> scalar tensor.", "loss=lambda logits: logits[0, -1, 7]"))
    require_points(wrt, "run_with_grad", "wrt")
    prompts, plan = prepare(model, tokens, spec, wrt, purpose="forward", verb="run_with_grad")
    addresses = sorted({Address.parse(a).resolve(model.n_layers) for a in ([wrt] if isinstance(wrt, str | Address) else wrt)})
    width = max(prompts.lengths)
    shapes = {}
    for a in addresses:
        feat = feature_shape(a, model.dims, width)
        shapes[a] = (len(prompts), *feat[:1], width, *feat[1:]) if a.info.pos_axis == 2 else (len(prompts), width, *feat)
    model.runtime.load()  # here, not lazily inside torch.func's transform (loading calls requires_grad_)
    value, grads = model.runtime.forward_with_grad(prompts, plan, loss=_scalar(loss), wrt=tuple(addresses),
                                                   shapes=shapes)
    return Gradients(value=value, grads=Cache(grads, prompts.lengths, model.n_layers, model.name))


def _scalar(loss: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def checked(logits: Tensor) -> Tensor:
        value = loss(logits)
        if not isinstance(value, Tensor) or value.numel() != 1:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise SpecError(fix(f"loss returned {shape}; gradients need a scalar.", "reduce it, e.g. .sum() or .mean()."))
        return value.reshape(())
    return checked
