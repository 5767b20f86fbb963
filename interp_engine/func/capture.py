from collections.abc import Sequence

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.func._prepare import checked_arguments, prepare, require_points
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.sae import Features, flat
from interp_engine.spec import Op, Spec


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def capture(model: ModelHandle, tokens: PromptsLike, points: Sequence[str | Address | Features] | str | Address | Features,
            spec: Spec | Op | Sequence[Op] | None = None, *, batch_size: int = 32, progress: bool = True) -> Cache:
    """Activations at `points`, read after the spec's edits. Ragged prompts: rows right-padded with zeros.
    `sae.features` reads an SAE's feature activations: `cache[sae.features]` is (batch, pos, d_sae)."""
    require_points(points, "capture", "points")
    prompts, plan = prepare(model, tokens, spec, points, purpose="forward", verb="capture", batch_size=batch_size)
    _, records = model.runtime.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=progress)
    return Cache(_with_features(records, points, model.n_layers, prompts.lengths), prompts.lengths, model.n_layers,
                 model.name)


def _with_features(records: dict, points, n_layers: int, lengths: tuple[int, ...]) -> dict:
    """Each `Features` read encoded from its point's record (padding zeroed: an SAE of zeros is not zero); a
    point read only for its features is left out."""
    points = [points] if isinstance(points, str | Address | Features) else list(points)
    features = [p for p in points if isinstance(p, Features)]
    if not features:
        return records
    asked = {Address.parse(p).resolve(n_layers) for p in points if not isinstance(p, Features)}
    out = {a: t for a, t in records.items() if a in asked}
    for read in features:
        x = records[read.sae.reads.resolve(n_layers)]
        valid = torch.arange(x.shape[1])[None, :] < torch.tensor(lengths)[:, None]
        acts = read.sae.encode(flat(x))
        out[read] = torch.where(valid[..., None].to(acts.device), acts, 0.0)
    return out
