import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.errors import SpecError, fix
from interp_engine.func._prepare import checked_arguments, prepare
from interp_engine.func.shapes import checked_result
from interp_engine.handle import ModelHandle
from interp_engine.inputs import PromptsLike
from interp_engine.spec import MAX_INDEX, Op, Spec, shown
from interp_engine.typing import Tokens


@dataclass(frozen=True, slots=True)
class Generation:
    """What `generate` returns: new tokens and text per prompt, the full sequences, optional captures.

    `sequences` is [batch, pos] right-padded with the pad id; `lengths` says where each row ends.
    `cache` (when `capture=` was given) holds the generated positions only, one per new token.
    """

    tokens: tuple[tuple[int, ...], ...]
    text: tuple[str, ...]
    sequences: Tokens
    lengths: tuple[int, ...]
    cache: Cache | None = None


@checked_arguments
@jaxtyped(typechecker=beartype)
@checked_result
def generate(model: ModelHandle, prompts: PromptsLike, spec: Spec | Op | Sequence[Op] | None = None, *,
             max_new_tokens: int = 32, capture: Sequence[str | Address] | None = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_at_eos: bool = True, batch_size: int = 32, progress: bool = True) -> Generation:
    """Generate with the spec's edits applied at every step (greedy at temperature 0, else sampled).

    Positions mean what they mean in `steer`: indices count in each prompt's own sequence, so an index past
    the prompt lands on a generated token; "last" is the newest token at every step.
    """
    if max_new_tokens < 1:
        raise SpecError(fix(f"max_new_tokens={shown(max_new_tokens)} generates nothing.", "pass max_new_tokens >= 1."))
    if not 0 <= temperature < math.inf or (top_p is not None and not 0 < top_p <= 1) or (
            top_k is not None and not 1 <= top_k <= MAX_INDEX):
        raise SpecError(fix(f"sampling settings temperature={temperature}, top_k={shown(top_k)}, top_p={top_p} are "
                            "out of range.",
                            f"use a finite temperature >= 0, top_k in 1..{MAX_INDEX}, 0 < top_p <= 1."))
    if seed is not None and not 0 <= seed < 2**63:
        raise SpecError(fix(f"seed={shown(seed)} is outside 0..2**63-1, what every backend's generator takes.",
                            "use a non-negative seed below 2**63, e.g. seed=0."))
    reads = capture or ()
    batch, plan = prepare(model, prompts, spec, reads, purpose="generate", verb="generate", batch_size=batch_size)
    longest = max(batch.lengths) + max_new_tokens
    if longest > model.dims.max_len:
        raise SpecError(fix(f"a prompt of {max(batch.lengths)} tokens plus {shown(max_new_tokens)} new ones exceeds "
                            f"the model's {model.dims.max_len} positions.",
                            "lower max_new_tokens or shorten the prompt."))
    new, records = model.runtime.generate(batch, plan, max_new_tokens=max_new_tokens, temperature=temperature,
                                          top_k=top_k, top_p=top_p, seed=seed, stop_at_eos=stop_at_eos,
                                          batch_size=batch_size, progress=progress)
    full = [list(p) + list(n) for p, n in zip(batch.ids, new)]
    width = max(len(f) for f in full)
    sequences = torch.full((len(full), width), model.runtime.pad_id, dtype=torch.long)
    for i, row in enumerate(full):
        sequences[i, : len(row)] = torch.tensor(row)
    cache = None
    if capture is not None:
        cache = Cache(records, tuple(len(n) for n in new), model.n_layers, model.name)
    return Generation(tokens=tuple(tuple(n) for n in new), text=tuple(model.runtime.decode(n) for n in new),
                      sequences=sequences, lengths=tuple(len(f) for f in full), cache=cache)
