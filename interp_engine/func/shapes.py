"""Every result leaving a public function is checked by jaxtyping against its return annotation, in the axes
of typing.py, with the model's sizes bound: `d_model` must be this model's d_model, not merely consistent.

How sizes bind: each check runs in its own `jaxtyped("context")` memo; `bind_model` puts the model's sizes in it
first, then tensors bind `batch`, `pos`, ... as they are checked. A Cache gets a memo of its own (a Generation's
cache has other positions than its sequences) with `batch` bound to its number of prompts, and each tensor in it
is checked against its point's axes (addresses.POINTS). A dataclass result is checked field by field.
"""

import dataclasses
import functools
import types
import typing
from collections.abc import Callable

from beartype.door import is_bearable
from jaxtyping import Shaped, jaxtyped
from torch import Tensor

from interp_engine.cache import Cache
from interp_engine.errors import ResultTypeError, fix
from interp_engine.sae import Features, TopFeatures
from interp_engine.typing import (MODEL_AXES, FeatureActs, TopFeatureActs, TopFeatureIds, activation, bind_model,
                                  meta)

_BATCH = Shaped[Tensor, "batch"]


def checked_result(function: Callable) -> Callable:
    """Check what `function(model, ...)` returns against its return annotation, sizes bound to `model`."""
    hint = typing.get_type_hints(function)["return"]

    @functools.wraps(function)
    def wrapper(model, *args, **kwargs):
        out = function(model, *args, **kwargs)
        check_result(out, hint, model, what=f"{function.__name__}()")
        return out

    return wrapper


def check_result(value, hint, model, *, what: str) -> None:
    """Raise ResultTypeError unless `value` is a `hint` for `model` (a ModelHandle)."""
    if hint is Cache:  # it binds a memo of its own
        return _check_cache(value, model, what)
    with jaxtyped("context"):
        bind_model(model.dims)
        _check(value, hint, model, what)


def _check(value, hint, model, what: str) -> None:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [h for h in typing.get_args(hint) if h is not type(None)]
        if value is None and len(members) < len(typing.get_args(hint)):
            return
        if len(members) == 1:  # `X | None`: check X's axes
            hint = members[0]
        else:  # a wider union: the member the value is (a dataclass by its type, a tensor by the tensor alias)
            hint = next((m for m in members if dataclasses.is_dataclass(m) and isinstance(value, m)), None) or next(
                (m for m in members if hasattr(m, "dim_str") and isinstance(value, Tensor)), hint)
    if hint is Cache:
        return _check_cache(value, model, what)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, hint):
            _refuse(what, f"a {type(value).__name__}", hint.__name__, "wrong type", model)
        for name, field_hint in _fields(hint):
            _check(getattr(value, name), field_hint, model, f"{what}.{name}")
        return
    if hasattr(hint, "dim_str"):  # a jaxtyping alias
        if not isinstance(value, hint):
            reason = hint.__instancecheck_str__(value) or "its sizes disagree with the other results"
            _refuse(what, _shown(value), hint.__name__, reason, model)
        return
    if not is_bearable(value, hint):
        _refuse(what, f"a {type(value).__name__}", getattr(hint, "__name__", str(hint)), "wrong type", model)


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, object], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, hints[f.name]) for f in dataclasses.fields(cls))


def _check_cache(cache, model, what: str) -> None:
    if not isinstance(cache, Cache):
        _refuse(what, f"a {type(cache).__name__}", "Cache", "wrong type", model)
    with jaxtyped("context"):
        bind_model(model.dims)
        isinstance(meta((len(cache.lengths),)), _BATCH)
        verified = set()
        for address, t in cache.tensors.items():
            if isinstance(address, Features) and address.top_k is not None:
                if not (isinstance(t, TopFeatures) and isinstance(t.values, TopFeatureActs)
                        and isinstance(t.indices, TopFeatureIds)
                        and t.values.shape == t.indices.shape and t.shape[-1] == address.top_k):
                    _refuse(f"{what}[{address}]", _shown(t), f"TopFeatures (k={address.top_k}, int64 indices)",
                            "its parts' shapes or dtypes are not a top-k read's", model)
                continue
            if isinstance(address, Features):  # d_sae is the SAE's own, not the model's: checked here, not bound
                if not isinstance(t, FeatureActs) or t.shape[-1] != address.sae.d_sae:
                    _refuse(f"{what}[{address}]", _shown(t), f"FeatureActs (d_sae={address.sae.d_sae})",
                            FeatureActs.__instancecheck_str__(t) or "its width is not the SAE's", model)
                continue
            hint = activation(address.info.axes)
            # Every layer of a point comes back alike: a shape already checked against the same hint in this memo
            # binds nothing new, so only the first of each is checked by jaxtyping (~10 us each, not per tensor).
            seen = (hint, type(t), t.dtype, t.shape, address.layer if model.dims.layer_sizes else None)
            if seen in verified:
                continue
            verified.add(seen)
            own = model.dims.at(address.layer)
            if own is not model.dims:  # a layer with sizes of its own (Gemma 4's global heads): its own memo
                with jaxtyped("context"):
                    bind_model(own)
                    isinstance(meta((len(cache.lengths),)), _BATCH)
                    fits = isinstance(t, hint)
            else:
                fits = isinstance(t, hint)
            if not fits:
                reason = hint.__instancecheck_str__(t) or "its sizes disagree with the cache's other tensors"
                _refuse(f"{what}[{str(address)!r}]", _shown(t), hint.__name__, reason, model)
            if address.info.pos_axis == 2 and t.shape[-1] != t.shape[-2]:
                _refuse(f"{what}[{str(address)!r}]", _shown(t), hint.__name__,
                        "a cache holds square patterns (q_pos == k_pos)", model)


def _shown(value) -> str:
    return f"shaped {tuple(value.shape)} ({value.dtype})" if isinstance(value, Tensor) else f"a {type(value).__name__}"


def _refuse(what: str, shown: str, expected: str, reason: str, model) -> None:
    dims = ", ".join(f"{k}={getattr(model.dims, k)}" for k in MODEL_AXES if getattr(model.dims, k))
    raise ResultTypeError(fix(
        f"{what} came back {shown}, not {expected} for {model.name!r} ({dims}): {reason}.",
        f"this is a bug in interp_engine or its {model.backend} backend, not in the call; please report it "
        "with this message."))
