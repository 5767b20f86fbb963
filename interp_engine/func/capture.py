from collections.abc import Sequence

from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.func._prepare import checked_arguments, prepare, require_points
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.spec import Op, Spec


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def capture(model: ModelHandle, tokens: PromptsLike, points: Sequence[str | Address] | str | Address,
            spec: Spec | Op | Sequence[Op] | None = None, *, batch_size: int = 32, progress: bool = True) -> Cache:
    """Activations at `points`, read after the spec's edits. Ragged prompts: rows right-padded with zeros."""
    require_points(points, "capture", "points")
    prompts, plan = prepare(model, tokens, spec, points, purpose="forward", verb="capture", batch_size=batch_size)
    _, records = model.runtime.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=progress)
    return Cache(records, prompts.lengths, model.n_layers, model.name)
