from collections.abc import Sequence

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.errors import SpecError, fix
from interp_engine.func._prepare import checked_arguments, prepare
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.spec import Op, Spec
from interp_engine.typing import LogProbs


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def logit_lens(model: ModelHandle, tokens: PromptsLike, *, points: Sequence[str | Address] | None = None,
               spec: Spec | Op | Sequence[Op] | None = None, batch_size: int = 32,
               progress: bool = True) -> LogProbs:
    """Next-token log-probs read off each point through the final norm and unembedding.

    `points` default to resid_post at every layer; any point with d_model features works (resid_*, attn_out,
    mlp_out, embed, final). Row `i` of the result is `points[i]`. Padded positions are zeros.
    """
    if isinstance(points, str | Address):
        points = [points]
    if points is not None and len(points) == 0:
        raise SpecError(fix("logit_lens() got points=[]: no point to read.",
                            'leave points unset (resid_post at every layer), or name some: points=["resid_post.1"].'))
    chosen = [Address.parse(p) for p in points] if points is not None else \
        [Address("resid_post", i) for i in range(model.n_layers)]
    bad = [str(a) for a in chosen if a.info.axes != ("batch", "pos", "d_model")]
    if bad:
        raise SpecError(fix(f"the logit lens reads the residual stream; {', '.join(bad)} is not d_model-shaped.",
                            "use resid_pre/resid_mid/resid_post, attn_out, mlp_out, embed or final."))
    prompts, plan = prepare(model, tokens, spec, chosen, purpose="forward", verb="logit_lens", batch_size=batch_size)
    logprobs = model.runtime.lens(prompts, plan, batch_size=batch_size, progress=progress)
    return torch.stack([logprobs[a.resolve(model.n_layers)] for a in chosen])
