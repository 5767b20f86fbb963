from collections.abc import Sequence

from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.func._prepare import checked_arguments, prepare
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.positions import position_index
from interp_engine.spec import Op, Spec
from interp_engine.typing import Logits


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def steer(model: ModelHandle, tokens: PromptsLike, spec: Spec | Op | Sequence[Op] | None, *,
          positions: int | Sequence[int] | str | None = None, batch_size: int = 32, progress: bool = True) -> Logits:
    """Logits of the forward pass with the spec's edits (none: `spec=None`, what `forward` does). Ragged prompts:
    padded positions are zeros. `positions` keeps only those positions, as logit_lens's: an index or a list of
    them in each prompt's own sequence (negative from its end), or "last"."""
    return _logits(model, tokens, spec, positions, batch_size, progress, verb="steer")


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def forward(model: ModelHandle, tokens: PromptsLike, *, positions: int | Sequence[int] | str | None = None,
            batch_size: int = 32, progress: bool = True) -> Logits:
    """Plain logits, no edits: `steer(model, tokens, None)`. Ragged prompts: padded positions are zeros.
    `positions` as steer's."""
    return _logits(model, tokens, None, positions, batch_size, progress, verb="forward")


def _logits(model, tokens, spec, positions, batch_size: int, progress: bool, *, verb: str):
    prompts, plan = prepare(model, tokens, spec, (), purpose="forward", verb="steer", batch_size=batch_size)
    index = None if positions is None else position_index(positions, prompts.lengths, verb)
    logits, _ = model.runtime.forward(prompts, plan, batch_size=batch_size, want_logits=True, progress=progress,
                                      logits_at=index)
    return logits
