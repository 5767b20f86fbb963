"""What every pure function does first: normalise inputs and validate everything before any forward pass."""

import difflib
import functools
import inspect
import re
import typing
from collections.abc import Callable, Iterable

from jaxtyping import TypeCheckError

from interp_engine.addresses import Address
from interp_engine.backends import serving
from interp_engine.errors import BackendError, InputTypeError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.inputs import Prompts, to_prompts
from interp_engine.sae import Features
from interp_engine.spec import as_spec
from interp_engine.validate import Plan, plan


def prepare(model, tokens, spec, reads: Iterable, *, purpose: str, verb: str,
            batch_size: int = 1) -> tuple[Prompts, Plan]:
    if not isinstance(model, ModelHandle):
        raise InputTypeError(fix(f"{verb}() takes a model handle first, got {type(model).__name__}.",
                                 f'model = load_model("path/or/repo"); {verb}(model, ...).'))
    if not model.capabilities.serves(verb):
        names = " or ".join(f'backend="{b}"' for b in serving(verb))
        raise BackendError(fix(f"{verb}() is not served by backend={model.backend!r}.",
                               f"load the model with {names}."))
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InputTypeError(fix(f"batch_size={batch_size!r} must be a positive int.", "e.g. batch_size=16."))
    prompts = to_prompts(tokens, tokenize=model.tokenize, d_vocab=model.d_vocab, max_len=model.dims.max_len)
    read_list = _addresses(reads, verb)
    return prompts, plan(model, as_spec(spec), read_list, n_prompts=len(prompts), longest=max(prompts.lengths),
                         purpose=purpose)


# What each parameter of the pure functions takes, said as the fix for a value of the wrong type.
_REMEDIES = {
    "model": 'model = load_model("path/or/repo"), then pass the handle first: {verb}(model, ...).',
    "tokens": 'pass a string, a list of strings, model.to_tokens(text), or a list of token-id lists.',
    "prompts": 'pass a string, a list of strings, model.to_tokens(text), or a list of token-id lists.',
    "points": 'pass addresses: ["resid_post.3", Address("attn_out", 0)] (capture also takes sae.features).',
    "wrt": 'pass addresses: ["resid_post.3", Address("attn_out", 0)], or an SAE\'s sae.features.',
    "capture": 'pass addresses: capture=["resid_post.3"].',
    "spec": 'pass an op (S.Add("resid_post.3", vector)), a Spec, or a list of ops; read a saved one with '
            'Spec.from_dict(json.load(f)).',
    "loss": "pass a function of the logits, e.g. loss=lambda logits: logits[0, -1, 7].",
}


def checked_arguments(function: Callable) -> Callable:
    """Refuse an unknown keyword (naming the nearest) or an argument of the wrong type (naming what it takes)
    with an InputTypeError, before the type checker or the function body sees it."""
    signature = inspect.signature(function)
    hints = typing.get_type_hints(inspect.unwrap(function))
    verb = function.__name__

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from beartype.door import is_bearable

        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            unknown = next((k for k in kwargs if k not in signature.parameters), None)
            names = list(signature.parameters)
            if unknown is None:
                raise InputTypeError(fix(f"{verb}(): {e}.", f"{verb} takes {', '.join(names)}.")) from None
            near = difflib.get_close_matches(unknown, names, n=1, cutoff=0.0)
            raise InputTypeError(fix(f"{verb}() has no keyword {unknown!r}.",
                                     f"did you mean {near[0]!r}? {verb} takes {', '.join(names)}.")) from None
        for name, value in bound.arguments.items():
            hint = hints.get(name)
            if hint is not None and not is_bearable(value, hint):
                shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
                remedy = _REMEDIES.get(name, f"pass {name}= as {_plain(hint)}.").format(verb=verb)
                raise InputTypeError(fix(f"{verb}(): {name}={shown} is not what {name} takes.", remedy))
        try:
            with bound.arguments["model"].runtime.calling():
                return function(*args, **kwargs)
        except TypeCheckError as e:
            # is_bearable above checks one element of a list, picked at random, and so does the decorator: on a
            # list with one bad element the two picks can differ. Only the parameter check is turned into ours.
            if "whilst checking the parameters" not in str(e):
                raise
            found = _PARAMETER.search(str(e))
            if found is None:  # jaxtyping could not say which
                raise InputTypeError(fix(f"{verb}(): an argument holds an element that is not what it takes.",
                                         "check every list element: token ids are ints, points are addresses, "
                                         "a spec holds ops.")) from None
            name = found[1]
            remedy = _REMEDIES.get(name, f"pass {name}= as {_plain(hints.get(name))}.").format(verb=verb)
            raise InputTypeError(fix(f"{verb}(): {name}= holds an element that is not what {name} takes.",
                                     remedy)) from None

    return wrapper


_PARAMETER = re.compile(r"typechecking parameter '(\w+)'")


def _plain(hint) -> str:
    return str(hint).replace("typing.", "").replace("collections.abc.", "").replace("<class '", "").replace("'>", "")


def _addresses(reads: Iterable, verb: str) -> list[Address | Features]:
    if isinstance(reads, str | Address | Features):
        reads = [reads]
    try:
        return [r if isinstance(r, Features) else Address.parse(r) for r in reads]
    except TypeError:
        raise InputTypeError(fix(f"{verb}() points must be a list of addresses.",
                                 '["resid_post.3", Address("attn_out", 0)]')) from None


def require_points(points, verb: str, name: str) -> None:
    """An empty list of points would run a forward pass for nothing."""
    if not isinstance(points, str | Address | Features) and len(points) == 0:
        raise SpecError(fix(f"{verb}() got {name}=[]: no point to read, so there is nothing to return.",
                            f'name at least one point, e.g. {name}=["resid_post.0"]'
                            + ("; steer() returns the logits." if verb == "capture" else ".")))
