"""The model handle: frozen config and dims plus a reference to the backend runtime that holds the weights."""

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from jaxtyping import Int
from torch import Tensor

from interp_engine.addresses import POINTS, Address
from interp_engine.arch import Arch, Dims, ModelConfig
from interp_engine.arch.layers import lacking
from interp_engine.backends.base import Capabilities, Runtime
from interp_engine.errors import InputTypeError, SpecError, fix
from interp_engine.taps import Taps
from interp_engine.weights import Weights


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
    cfg: ModelConfig
    runtime: Runtime = field(repr=False, compare=False)
    taps: Taps | None = None  # vllm-static: the points its engine is compiled to read and write
    # The load_model call that made this handle, as keywords: a replicated harvest loads the same model in each
    # replica from it (None for a handle not made by load_model).
    load_call: tuple[tuple[str, object], ...] | None = field(default=None, repr=False, compare=False)

    n_layers = property(lambda self: self.dims.n_layers)
    d_model = property(lambda self: self.dims.d_model)
    n_heads = property(lambda self: self.dims.n_heads)
    n_kv_heads = property(lambda self: self.dims.n_kv_heads)
    d_head = property(lambda self: self.dims.d_head)
    d_mlp = property(lambda self: self.dims.d_mlp)
    d_vocab = property(lambda self: self.dims.d_vocab)

    def __repr__(self) -> str:
        c = self.cfg
        state = "loaded" if self.is_loaded else "not loaded"
        return (f"ModelHandle({self.name!r}, backend={self.backend!r}, {c.family} {c.n_layers}L d_model={c.d_model} "
                f"heads={c.n_heads}, {self.device} {str(self.dtype).removeprefix('torch.')}, {state})")

    @property
    def tokenizer(self):
        """The checkpoint's own HF tokenizer (the one tokenize/to_tokens use)."""
        return self.runtime.tokenizer

    @property
    def weights(self) -> Weights:
        """Every weight in TransformerLens's names and shapes (interp_engine/weights.py); read-only by contract.
        Loads the model if needed."""
        return self.runtime.weights()

    W_E = property(lambda self: self.weights.W_E)
    W_pos = property(lambda self: self.weights.W_pos)
    W_U = property(lambda self: self.weights.W_U)
    b_U = property(lambda self: self.weights.b_U)
    # Per-layer weights stacked over layers, [n_layers, ...], as TransformerLens's model.W_Q.
    W_Q = property(lambda self: self.weights.stacked("W_Q"))
    W_K = property(lambda self: self.weights.stacked("W_K"))
    W_V = property(lambda self: self.weights.stacked("W_V"))
    W_O = property(lambda self: self.weights.stacked("W_O"))
    W_in = property(lambda self: self.weights.stacked("W_in"))
    W_gate = property(lambda self: self.weights.stacked("W_gate"))
    W_out = property(lambda self: self.weights.stacked("W_out"))

    @property
    def capabilities(self) -> Capabilities:
        """What this handle serves: its backend's verbs and points, narrowed by its attention, declared taps, or
        the points its architecture has (a discovered one: the residual stream)."""
        capabilities = self.runtime.capabilities
        if self.arch.points is None:
            return capabilities
        return dataclasses.replace(capabilities, served=frozenset(self.arch.points))

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
            if ((info.needs_eager_attention and not capabilities.patterns)
                    or (capabilities.served is not None and info.name not in capabilities.served)
                    or (info.eager_only_read and not capabilities.eager_only_reads)
                    or self.arch.lacks(info.name)):
                continue
            if info.layered:
                kinds = self.dims.layer_kinds
                out += [Address(info.name, i) for i in range(self.n_layers) if lacking(info.name, i, kinds) is None]
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

    def to_str_tokens(self, tokens: "str | Sequence[str] | Tensor | Sequence[int]", *,
                      prepend_bos: bool = True) -> list[str] | list[list[str]]:
        """Each token as its own string: a text, a list of ids or a [pos] tensor -> list[str]; a list of texts
        or a [batch, pos] tensor -> one list per row. `prepend_bos` applies to text only."""
        if isinstance(tokens, str):
            return self.to_str_tokens(self.tokenize(tokens, prepend_bos=prepend_bos))
        if isinstance(tokens, Tensor) and tokens.ndim == 2 or (
                isinstance(tokens, Sequence) and tokens and not isinstance(tokens[0], int | Tensor)):
            return [self.to_str_tokens(row, prepend_bos=prepend_bos) for row in tokens]
        ids = tokens.tolist() if isinstance(tokens, Tensor) else [int(t) for t in tokens]
        return [self.runtime.decode([i]) for i in ids]

    def to_single_token(self, text: str) -> int:
        """The id of the one token `text` is (no BOS). A text of several tokens, or none, is refused."""
        if not isinstance(text, str):
            raise InputTypeError(fix(f"to_single_token takes a string, got a {type(text).__name__}.",
                                     'e.g. model.to_single_token(" Paris").'))
        ids = self.tokenize(text, prepend_bos=False)
        unk = getattr(self.tokenizer, "unk_token_id", None)
        if len(ids) == 1 and (unk is None or ids[0] != unk):
            return ids[0]
        if not ids or (unk is not None and unk in ids):
            raise SpecError(fix(f"{text!r} is not a token in the vocabulary of {self.name!r}.",
                                "pass text the tokenizer knows; model.to_str_tokens(text) shows how it splits."))
        pieces = self.to_str_tokens(ids)
        raise SpecError(fix(f"{text!r} is {len(ids)} tokens, {pieces}, not one.",
                            f"pass one of them, e.g. model.to_single_token({pieces[0]!r}), or use "
                            "model.to_tokens(text) for several."))

    def get_token_position(self, token: str | int, tokens: "str | Tensor | Sequence[int]", *,
                           mode: str = "first", prepend_bos: bool = True) -> int:
        """Where `token` (a single-token string or an id) first (mode="first") or last (mode="last") occurs in
        one sequence (a text, a [pos] or [1, pos] tensor, or a list of ids)."""
        if mode not in ("first", "last"):
            raise SpecError(fix(f"mode={mode!r} is not a mode.", 'use mode="first" or mode="last".'))
        wanted = self.to_single_token(token) if isinstance(token, str) else int(token)
        if isinstance(tokens, str):
            ids = self.tokenize(tokens, prepend_bos=prepend_bos)
        elif isinstance(tokens, Tensor):
            if tokens.ndim == 2 and tokens.shape[0] != 1 or tokens.ndim > 2:
                raise SpecError(fix(f"get_token_position reads one sequence; got a tensor shaped "
                                    f"{tuple(tokens.shape)}.", "pass one row: tokens[i]."))
            ids = tokens.reshape(-1).tolist()
        else:
            ids = [int(t) for t in tokens]
        where = [i for i, t in enumerate(ids) if t == wanted]
        if not where:
            raise SpecError(fix(f"token {wanted} ({self.runtime.decode([wanted])!r}) does not occur in the "
                                f"{len(ids)} tokens given.", "check model.to_str_tokens(tokens) for the tokens there."))
        return where[0] if mode == "first" else where[-1]
