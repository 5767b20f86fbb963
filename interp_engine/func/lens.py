from collections.abc import Sequence
from dataclasses import dataclass

import torch
from beartype import beartype
from jaxtyping import Float, Int, jaxtyped
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.errors import SpecError, fix
from interp_engine.func._prepare import checked_arguments, prepare
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.positions import at_positions, position_index
from interp_engine.spec import Op, Spec
from interp_engine.typing import LogProbs


# Aliases, not inline annotations: a string in an annotation reads as a forward reference to linters.
TopLogProbs = Float[Tensor, "layer batch pos k"]
TopTokens = Int[Tensor, "layer batch pos k"]


@dataclass(frozen=True, slots=True)
class LensTop:
    """`logit_lens(..., top_k=k)`: the k likeliest next tokens at each point, prompt and position, most likely
    first: their log-probs and their ids."""

    logprobs: TopLogProbs
    tokens: TopTokens


def lens_points(model: ModelHandle, points: Sequence[str | Address] | str | Address | None,
                top_k: int | None) -> list[Address]:
    """The points a lens reads (None: resid_post at every layer), checked with `top_k` (also by the server)."""
    if isinstance(points, str | Address):
        points = [points]
    if points is not None and len(points) == 0:
        raise SpecError(fix("logit_lens() got points=[]: no point to read.",
                            'leave points unset (resid_post at every layer), or name some: points=["resid_post.1"].'))
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or
                              not 1 <= top_k <= model.d_vocab):
        raise SpecError(fix(f"top_k={top_k!r} is outside 1..{model.d_vocab} (the vocabulary's size).",
                            f"pass top_k in 1..{model.d_vocab}, or leave it unset for every token's log-prob."))
    chosen = [Address.parse(p) for p in points] if points is not None else \
        [Address("resid_post", i) for i in range(model.n_layers)]
    bad = [str(a) for a in chosen if a.info.axes != ("batch", "pos", "d_model")]
    if bad:
        raise SpecError(fix(f"the logit lens reads the residual stream; {', '.join(bad)} is not d_model-shaped.",
                            "use resid_pre/resid_mid/resid_post, attn_out, mlp_out, embed or final."))
    return chosen


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def logit_lens(model: ModelHandle, tokens: PromptsLike, *, points: Sequence[str | Address] | None = None,
               spec: Spec | Op | Sequence[Op] | None = None, positions: int | Sequence[int] | str | None = None,
               top_k: int | None = None, batch_size: int = 32, progress: bool = True) -> LogProbs | LensTop:
    """Next-token log-probs read off each point through the final norm and unembedding.

    `points` default to resid_post at every layer; any point with d_model features works (resid_*, attn_out,
    mlp_out, embed, final). Row `i` of the result is `points[i]`. Padded positions are zeros.
    `positions` keeps only those positions: an index or a list of them, each counted in each prompt's own
    sequence (negative from its end), or "last" (each prompt's last token). `top_k` returns a LensTop (the k
    likeliest tokens and their log-probs) instead of the whole vocabulary.
    """
    chosen = lens_points(model, points, top_k)
    prompts, plan = prepare(model, tokens, spec, chosen, purpose="forward", verb="logit_lens", batch_size=batch_size)
    index = None if positions is None else position_index(positions, prompts.lengths, "logit_lens")
    logprobs = model.runtime.lens(prompts, plan, batch_size=batch_size, progress=progress)
    return lens_result(torch.stack([logprobs[a.resolve(model.n_layers)] for a in chosen]), index, top_k)


def lens_result(out: Tensor, index: Tensor | None, top_k: int | None) -> Tensor | LensTop:
    """[layer, batch, pos, d_vocab] log-probs -> kept at each prompt's `index` positions, and their top k."""
    if index is not None:
        out = at_positions(out, index, dim=2)
    if top_k is None:
        return out
    values, ids = out.topk(top_k, dim=-1)
    return LensTop(logprobs=values, tokens=ids)
