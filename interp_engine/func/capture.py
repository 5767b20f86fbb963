from collections.abc import Sequence

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.func._prepare import checked_arguments, prepare, require_points
from interp_engine.func.shapes import check_result, checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.sae import Features, flat
from interp_engine.spec import Op, Spec
from interp_engine.typing import Logits


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def capture(model: ModelHandle, tokens: PromptsLike,
            points: Sequence[str | Address | Features] | str | Address | Features,
            spec: Spec | Op | Sequence[Op] | None = None, *, batch_size: int = 32, progress: bool = True,
            dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> Cache:
    """Activations at `points`, read after the spec's edits. Ragged prompts: rows right-padded with zeros.
    `sae.features` reads an SAE's feature activations: `cache[sae.features]` is (batch, pos, d_sae);
    `sae.top_features(k)` only each position's k largest: `values, indices = cache[sae.top_features(k)]`.
    `dtype=` and `device=` convert what is returned (e.g. torch.float16 to halve it, "cpu" off the GPU)."""
    require_points(points, "capture", "points")
    prompts, plan = prepare(model, tokens, spec, points, purpose="forward", verb="capture", batch_size=batch_size)
    _, records = model.runtime.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=progress)
    return Cache(_with_features(records, points, model.n_layers, prompts.lengths), prompts.lengths, model.n_layers,
                 model.name).to(device=device, dtype=dtype)


@checked_arguments
@jaxtyped(typechecker=beartype)
def run_with_cache(model: ModelHandle, tokens: PromptsLike,
                   points: Sequence[str | Address | Features] | str | Address | Features | None = None,
                   spec: Spec | Op | Sequence[Op] | None = None, *, batch_size: int = 32, progress: bool = True,
                   dtype: torch.dtype | None = None, device: str | torch.device | None = None
                   ) -> tuple[Logits, Cache]:
    """`(logits, cache)` from one forward pass (TransformerLens's run_with_cache). `points=None` reads every point
    this handle can read (`model.points()`): name the ones you need on a large model. `dtype=`/`device=` convert
    the cache, as in `capture`."""
    if points is None:
        points = model.points()
    require_points(points, "run_with_cache", "points")
    prompts, plan = prepare(model, tokens, spec, points, purpose="forward", verb="capture", batch_size=batch_size)
    logits, records = model.runtime.forward(prompts, plan, batch_size=batch_size, want_logits=True, progress=progress)
    cache = Cache(_with_features(records, points, model.n_layers, prompts.lengths), prompts.lengths, model.n_layers,
                  model.name).to(device=device, dtype=dtype)
    check_result(logits, Logits, model, what="run_with_cache() logits")
    check_result(cache, Cache, model, what="run_with_cache() cache")
    return logits, cache


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
        out[read] = read.read(flat(x), torch.arange(x.shape[1])[None, :] < torch.tensor(lengths)[:, None])
    return out
