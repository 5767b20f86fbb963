"""The client side of `interp-engine serve`: the `extra_body` of a request, and its captures as a `Cache`.

    from openai import OpenAI
    from interp_engine import client
    out = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="...").completions.create(
        model=PATH, prompt="Hello", max_tokens=8, extra_body=client.extra_body(spec, capture=["resid_post.1"]))
    cache = client.cache_of(out)   # [prompts, positions, ...]; client.tokens_of(out): the ids at those positions
    lens = client.lens_of(out)     # with extra_body(..., lens=True): as logit_lens returns it

Of a stream (stream=True), the last chunk holds the captures: `client.cache_of(list(stream))`.
"""

import base64
from collections.abc import Sequence
from typing import Any

from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.cache import Cache
from interp_engine.errors import SpecError, fix
from interp_engine.func.lens import LensTop
from interp_engine.spec import Op, Spec, as_spec


def extra_body(spec: Spec | Op | Sequence[Op] | None = None, *, capture: Sequence[str | Address] = (),
               dtype: str | None = None, positions: int | Sequence[int] | str | None = None,
               lens: bool | Sequence[str | Address] = False, top_k: int | None = None) -> dict[str, Any]:
    """`{"interp": {...}}` for a request: the spec as `Spec.to_dict()` (None: no edits, and the server's
    default spec switched off), the points to capture (dtype: "float16", "bfloat16" or "float32"), and the
    logit lens (True: resid_post at every layer, or the points to lens; `top_k` as logit_lens's). `positions`
    keeps only those of each row, as logit_lens's: an index, a list of them (negative from the row's end), or
    "last"; a row is the prompt and every generated token but the last."""
    kept = {} if positions is None else {"positions": positions if isinstance(positions, int | str)
                                         else list(positions)}
    points = [str(Address.parse(p)) for p in capture]
    body: dict[str, Any] = {"spec": None if spec is None else as_spec(spec).to_dict()}
    if points:
        body["capture"] = {"points": points, **({"dtype": dtype} if dtype else {}), **kept}
    if lens is not False:
        body["lens"] = {**({} if lens is True else {"points": [str(Address.parse(p)) for p in lens]}),
                        **({} if top_k is None else {"top_k": top_k}), **kept}
    return {"interp": body}


def _interp(response: Any) -> dict:
    """The `interp` field of a response, or of a stream's chunks (a list: the last chunk holds it)."""
    chunks = response if isinstance(response, list | tuple) else [response]
    for chunk in reversed(chunks):
        found = chunk.get("interp") if isinstance(chunk, dict) else getattr(chunk, "interp", None)
        if found is None and hasattr(chunk, "model_extra"):
            found = (chunk.model_extra or {}).get("interp")
        if isinstance(found, dict):
            return found
    raise SpecError(fix("this response has no interp field.",
                        "send the request with extra_body=client.extra_body(spec, capture=[...]) to "
                        "interp-engine serve; of a stream, pass its chunks as a list (list(stream))."))


def cache_of(response: Any) -> Cache:
    """A response's captures: per point [prompts, positions, ...], right-padded with zeros past each row's
    length; a row's positions are its prompt and every generated token but the last (see `tokens_of`)."""
    found = _interp(response)
    kept = found.get("positions")
    lengths = tuple(len(t) for t in (found.get("tokens", []) if kept is None else kept))
    return Cache({Address.parse(k): v for k, v in _loaded(found, "captures").items()}, lengths,
                 int(found["n_layers"]))


def lens_of(response: Any) -> Tensor | LensTop:
    """A response's logit lens, as `logit_lens` returns it: [points, prompts, positions, d_vocab] log-probs, or
    a LensTop with `top_k`. Its points are `_interp(response)["lens_points"]`; with positions, each row's are
    `["lens_positions"]`."""
    tensors = _loaded(_interp(response), "lens")
    if "logprobs" not in tensors:
        raise SpecError(fix("this response has no lens.", "send the request with client.extra_body(..., lens=True)."))
    return LensTop(tensors["logprobs"], tensors["tokens"]) if "tokens" in tensors else tensors["logprobs"]


def tokens_of(response: Any) -> list[list[int]]:
    """The token ids each row ran through the model: the prompt and every generated token but the last (the
    captured positions, or with positions, what they index)."""
    return [list(t) for t in _interp(response).get("tokens", [])]


def _loaded(found: dict, field: str) -> dict[str, Tensor]:
    from safetensors.torch import load

    blob = base64.b64decode(found.get(field) or "")
    return load(blob) if blob else {}
