"""The client side of `interp-engine serve`: the `extra_body` of a request, and its captures as a `Cache`.

    from openai import OpenAI
    from interp_engine import client
    out = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="...").completions.create(
        model=PATH, prompt="Hello", max_tokens=8, extra_body=client.extra_body(spec, capture=["resid_post.1"]))
    cache = client.cache_of(out)   # [prompts, positions, ...]; client.tokens_of(out): the ids at those positions
"""

import base64
from collections.abc import Sequence
from typing import Any

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.errors import SpecError, fix
from interp_engine.spec import Op, Spec, as_spec


def extra_body(spec: Spec | Op | Sequence[Op] | None = None, *, capture: Sequence[str | Address] = (),
               dtype: str | None = None) -> dict[str, Any]:
    """`{"interp": {...}}` for a request: the spec as `Spec.to_dict()` (None: no edits, and the server's
    default spec switched off) and the points to capture (dtype: "float16", "bfloat16" or "float32")."""
    points = [str(Address.parse(p)) for p in capture]
    body: dict[str, Any] = {"spec": None if spec is None else as_spec(spec).to_dict()}
    if points:
        body["capture"] = {"points": points, **({"dtype": dtype} if dtype else {})}
    return {"interp": body}


def _interp(response: Any) -> dict:
    found = response.get("interp") if isinstance(response, dict) else getattr(response, "interp", None)
    if found is None and hasattr(response, "model_extra"):
        found = (response.model_extra or {}).get("interp")
    if not isinstance(found, dict):
        raise SpecError(fix("this response has no interp field.",
                            "send the request with extra_body=client.extra_body(spec, capture=[...]) to "
                            "interp-engine serve."))
    return found


def cache_of(response: Any) -> Cache:
    """A response's captures: per point [prompts, positions, ...], right-padded with zeros past each row's
    length; a row's positions are its prompt and every generated token but the last (see `tokens_of`)."""
    from safetensors.torch import load

    found = _interp(response)
    blob = base64.b64decode(found.get("captures") or "")
    tensors = load(blob) if blob else {}
    lengths = tuple(len(t) for t in found.get("tokens", []))
    return Cache({Address.parse(k): v for k, v in tensors.items()}, lengths, int(found["n_layers"]))


def tokens_of(response: Any) -> list[list[int]]:
    """The token ids at each row's captured positions."""
    return [list(t) for t in _interp(response).get("tokens", [])]
