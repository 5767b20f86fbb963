"""The model handle: frozen config and dims plus a reference to the backend runtime that holds the weights."""

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import Tensor

from interp_engine.addresses import POINTS, Address
from interp_engine.arch import Arch, Dims
from interp_engine.backends.base import Capabilities, Runtime
from interp_engine.errors import InputTypeError, SpecError, fix
from interp_engine.taps import Taps


# Not slotted: a frozen, slotted dataclass answers an assignment to a non-field name (a property such as
# n_layers) with a TypeError from inside dataclasses instead of FrozenInstanceError.
@dataclass(frozen=True)
class ModelHandle:
    """An immutable handle. Setting an attribute raises; the pure functions never change the model."""

    name: str
    backend: str
    device: str
    dtype: torch.dtype
    attn_implementation: str
    requires_grad: bool
    arch: Arch
    dims: Dims
    runtime: Runtime = field(repr=False, compare=False)
    taps: Taps | None = None  # vllm-static: the points its engine is compiled to read and write

    n_layers = property(lambda self: self.dims.n_layers)
    d_model = property(lambda self: self.dims.d_model)
    n_heads = property(lambda self: self.dims.n_heads)
    n_kv_heads = property(lambda self: self.dims.n_kv_heads)
    d_head = property(lambda self: self.dims.d_head)
    d_mlp = property(lambda self: self.dims.d_mlp)
    d_vocab = property(lambda self: self.dims.d_vocab)

    @property
    def capabilities(self) -> Capabilities:
        """What this handle serves: its backend's verbs and points, narrowed by its attention or declared taps."""
        return self.runtime.capabilities

    @property
    def is_loaded(self) -> bool:
        return self.runtime.is_loaded

    async def warmup(self) -> "ModelHandle":
        """Load the weights (this is where the cost of loading lands). Returns the handle."""
        await asyncio.to_thread(self.runtime.load)
        return self

    async def shutdown(self) -> None:
        """Free the weights; the handle loads again lazily if used afterwards. On vLLM, calls still running on
        it end at once with a BackendError (they never load the model again)."""
        await asyncio.to_thread(self.runtime.unload)

    def points(self) -> tuple[Address, ...]:
        """Every address this handle can read, in point-table order (on vllm-static: the declared ones; on
        vllm-generate: none)."""
        capabilities = self.capabilities
        if not capabilities.points:
            return ()
        if capabilities.taps is not None:
            return tuple(sorted(capabilities.taps.readable(),
                                key=lambda a: (list(POINTS).index(a.point), a.layer or 0)))
        out = []
        for info in POINTS.values():
            if (info.needs_eager_attention and not capabilities.patterns) or self.arch.lacks(info.name):
                continue
            if info.layered:
                out += [Address(info.name, i) for i in range(self.n_layers)]
            else:
                out.append(Address(info.name))
        return tuple(out)

    def tokenize(self, text: str, *, prepend_bos: bool = True) -> list[int]:
        return self.runtime.tokenize(text, prepend_bos=prepend_bos)

    def to_tokens(self, text: str | Sequence[str], *, prepend_bos: bool = True) -> Int[Tensor, "batch pos"]:
        """Token ids, [batch, pos]. A ragged list is refused: pass the list itself to capture/steer instead."""
        texts = [text] if isinstance(text, str) else list(text) if hasattr(text, "__iter__") else None
        if texts is None or not all(isinstance(t, str) for t in texts):
            shown = repr(text) if len(repr(text)) <= 60 else f"a {type(text).__name__}"
            raise InputTypeError(fix(f"to_tokens takes a string or a list of strings, got {shown}.",
                                     'e.g. model.to_tokens("Hi") or model.to_tokens(["Hi", "Yo"]); token ids go '
                                     "straight to capture/steer/generate."))
        if not texts:
            raise SpecError(fix("to_tokens takes a string or a non-empty list of strings.", 'e.g. model.to_tokens("Hi")'))
        rows = [self.tokenize(t, prepend_bos=prepend_bos) for t in texts]
        if len({len(r) for r in rows}) > 1:
            raise SpecError(fix(
                f"these {len(rows)} texts tokenize to different lengths {[len(r) for r in rows]}; a tensor cannot "
                "hold them without padding that would be mistaken for tokens.",
                "pass the list of strings straight to capture/steer/generate: ragged batches are handled there."))
        return torch.tensor(rows, dtype=torch.long)

    def to_string(self, tokens: Tensor | Sequence[int]) -> str | list[str]:
        """Decode one sequence to a string, or a [batch, pos] tensor to a list of strings."""
        if isinstance(tokens, Tensor) and tokens.ndim == 2:
            return [self.runtime.decode(row.tolist()) for row in tokens]
        ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
        return self.runtime.decode(ids)
