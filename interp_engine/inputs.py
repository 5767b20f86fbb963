"""Prompts in every form a researcher passes them, normalised to token-id lists and checked up front."""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import Tensor

from interp_engine.errors import InputTypeError, SpecError, fix
from interp_engine.spec import shown

# Token ids come only from integer tensors: a float, bool or complex tensor would be truncated to ids silently.
_ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
              torch.uint64)

# Tensors are typed loosely here so that a float tensor reaches to_prompts' message (with its fix) rather
# than a type-checker dump; to_prompts checks the dtype and rank itself.
PromptsLike = Union[str, Sequence[str], Tensor, Sequence[Tensor], Sequence[Sequence[int]]]


@dataclass(frozen=True, slots=True)
class Prompts:
    """Token ids per prompt (ragged allowed)."""

    ids: tuple[tuple[int, ...], ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def chunks(self, batch_size: int) -> list[range]:
        return [range(i, min(i + batch_size, len(self))) for i in range(0, len(self), batch_size)]

    def right_padded(self, rows: range, pad_id: int) -> tuple[Tensor, Tensor]:
        """(ids [b, P] right-padded, lengths [b]): right padding keeps every real token's position and, under a
        causal mask, its attention, so no padding mask is needed and each row equals its solo run."""
        lengths = [len(self.ids[i]) for i in rows]
        width = max(lengths)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : lengths[r]] = torch.tensor(self.ids[i], dtype=torch.long)
        return ids, torch.tensor(lengths, dtype=torch.long)


def to_prompts(value: Any, *, tokenize, d_vocab: int, max_len: int, name: str = "prompts") -> Prompts:
    """Accept a string, a list of strings, a [batch, pos] id tensor, or a list of id sequences."""
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Tensor):
        _check_ids_dtype(value, name)
        if value.ndim == 1:
            value = value.unsqueeze(0)
        if value.ndim != 2:
            raise SpecError(fix(f"{name} tensor has shape {tuple(value.shape)}; expected [batch, pos].",
                                "pass model.to_tokens(text) or a list of 1-D id tensors."))
        rows = [tuple(int(t) for t in row) for row in value.tolist()]
    elif isinstance(value, Sequence):
        if len(value) == 0:
            raise SpecError(fix(f"{name} is empty: there is nothing to run.", "pass at least one prompt."))
        if all(isinstance(v, str) for v in value):
            rows = [tuple(tokenize(v)) for v in value]
        elif all(isinstance(v, Tensor) or (isinstance(v, Sequence) and not isinstance(v, str)) for v in value):
            rows = [_row(v, i, name) for i, v in enumerate(value)]
        else:
            raise InputTypeError(fix(f"{name} mixes strings and token ids.", "pass all strings or all id lists."))
    else:
        raise InputTypeError(fix(f"{name} must be text or token ids, got {type(value).__name__}.",
                                 "pass a string, a list of strings, or model.to_tokens(text)."))
    if not rows:
        raise SpecError(fix(f"{name} is empty: there is nothing to run.", "pass at least one prompt."))
    for i, row in enumerate(rows):
        if not row:
            raise SpecError(fix(f"prompt {i} has no tokens.", "drop empty prompts, or keep the BOS token."))
        bad = [t for t in row if not 0 <= t < d_vocab]
        if bad:
            raise SpecError(fix(f"prompt {i} has token ids outside the vocabulary (0..{d_vocab - 1}): "
                                f"[{', '.join(shown(t) for t in bad[:5])}].",
                                "tokenize with this model's tokenizer: model.to_tokens(text)."))
        if len(row) > max_len:
            raise SpecError(fix(f"prompt {i} has {len(row)} tokens; the model takes at most {max_len}.",
                                f"truncate it to {max_len} tokens."))
    return Prompts(tuple(rows))


def _check_ids_dtype(value: Tensor, name: str) -> None:
    if value.dtype not in _ID_DTYPES:
        raise InputTypeError(fix(f"{name} tensor has dtype {value.dtype}; token ids are integers.",
                                 "pass model.to_tokens(text), or ids.long() if they are ids already."))


def _row(value: Any, i: int, name: str) -> tuple[int, ...]:
    """One prompt's ids from a 1-D tensor or a list of ints; anything else (floats, bools, nested lists) refused."""
    if isinstance(value, Tensor):
        _check_ids_dtype(value, f"{name}[{i}]")
        return tuple(value.reshape(-1).tolist())
    bad = next((t for t in value if not isinstance(t, int) or isinstance(t, bool)), None)
    if bad is not None:
        raise InputTypeError(fix(f"prompt {i} holds {shown(bad)} ({type(bad).__name__}); token ids are ints.",
                                 "pass a list of int ids per prompt, e.g. model.to_tokens(text).tolist()."))
    return tuple(value)
