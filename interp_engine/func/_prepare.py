"""What every pure function does first: normalise inputs and validate everything before any forward pass."""

from collections.abc import Iterable

from interp_engine.addresses import Address
from interp_engine.errors import BackendError, InputTypeError, fix
from interp_engine.handle import ModelHandle
from interp_engine.inputs import Prompts, to_prompts
from interp_engine.spec import as_spec
from interp_engine.validate import Plan, plan

# Which backends serve each pure function in this build.
SERVED_BY = {
    "capture": ("eager", "vllm", "vllm-static"),
    "steer": ("eager", "vllm", "vllm-static"),
    "generate": ("eager", "vllm", "vllm-static", "vllm-generate"),
    "logit_lens": ("eager", "vllm", "vllm-static"),
    "run_with_grad": ("eager",),
}


def prepare(model, tokens, spec, reads: Iterable, *, purpose: str, verb: str,
            batch_size: int = 1) -> tuple[Prompts, Plan]:
    if not isinstance(model, ModelHandle):
        raise InputTypeError(fix(f"{verb}() takes a model handle first, got {type(model).__name__}.",
                                 f'model = load_model("path/or/repo"); {verb}(model, ...).'))
    served = SERVED_BY[verb]
    if model.backend not in served:
        names = " or ".join(f'backend="{b}"' for b in served)
        raise BackendError(fix(f"{verb}() is not served by backend={model.backend!r}.",
                               f"load the model with {names}."))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputTypeError(fix(f"batch_size={batch_size!r} must be a positive int.", "e.g. batch_size=16."))
    prompts = to_prompts(tokens, tokenize=model.tokenize, d_vocab=model.d_vocab, max_len=model.dims.max_len)
    read_list = _addresses(reads, verb)
    return prompts, plan(model, as_spec(spec), read_list, n_prompts=len(prompts), longest=max(prompts.lengths),
                         purpose=purpose)


def _addresses(reads: Iterable, verb: str) -> list[Address]:
    if isinstance(reads, str | Address):
        reads = [reads]
    try:
        return [Address.parse(r) for r in reads]
    except TypeError:
        raise InputTypeError(fix(f"{verb}() points must be a list of addresses.",
                                 '["resid_post.3", Address("attn_out", 0)]')) from None
