"""Tensors inside specs: plain data that compares and hashes by content, read from JSON with every size checked
before anything is decoded. Also the bounds on sizes and indices read from data, and a short, safe repr for
messages."""

import base64
import binascii
import hashlib
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from interp_engine.errors import InputTypeError, SpecError, fix

# Every floating dtype by its torch name ("float32", and aliases such as "float" and "half"), built once here.
FLOAT_DTYPES: dict[str, torch.dtype] = {name: t for name, t in vars(torch).items()
                                         if isinstance(t, torch.dtype) and t.is_floating_point}
# What a spec tensor may hold: the floats every backend can scan for NaN and cast on CPU. float8 and the other
# narrow floats have no CPU kernels for those scans (torch.isposinf raises), so a spec refuses them by name.
SPEC_DTYPES: dict[str, torch.dtype] = {name: t for name, t in FLOAT_DTYPES.items()
                                        if t in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}
# Bounds on sizes and indices read from data: far above any model (2**31 positions, heads or layers), far below
# where torch's int64 arithmetic overflows, and short enough to print in a message.
MAX_INDEX = 2**31 - 1
MAX_NDIM = 8
_CHUNK = 4 << 20  # base64 characters decoded at a time (a multiple of 4): the only copy beside the tensor


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxlong = 3, 40


def shown(value: Any, limit: int = 80) -> str:
    """repr for a message, short; never fails (Python refuses to print ints of more than 4300 digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = _SHORT.repr(value)  # reprlib: nested lists to three levels, so a deep one never recurses
    except (ValueError, RecursionError):
        return f"a {type(value).__name__} too large to print"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_index(value: Any) -> bool:
    """An int (not a bool) within +-MAX_INDEX."""
    return isinstance(value, int) and not isinstance(value, bool) and -MAX_INDEX <= value <= MAX_INDEX


def _checked(value: Any, what: str) -> tuple[torch.Tensor, str]:
    """A spec tensor as it is kept (detached, on the CPU, contiguous) and its content digest, or the error."""
    if not isinstance(value, torch.Tensor):
        raise InputTypeError(fix(f"{what} must be a torch.Tensor, got {type(value).__name__}.",
                                 f"wrap it: torch.tensor(...), e.g. {what}=torch.randn(d_model)."))
    if value.dtype not in SPEC_DTYPES.values():
        narrow = " (a float without the CPU kernels a spec's checks need)" if value.is_floating_point() else ""
        raise SpecError(fix(f"{what} has dtype {value.dtype}{narrow}; edits need a floating-point tensor: "
                            "float16, bfloat16, float32 or float64.",
                            f"pass {what}.float() (it is cast to the model dtype at run time)."))
    t = value.detach().cpu().contiguous()
    flat = t.reshape(-1)
    # In slices, so that a large vector costs no second full-size (bool) tensor.
    if any(bool(torch.isnan(c).any()) or bool(torch.isposinf(c).any()) for c in flat.split(1 << 22)):
        raise SpecError(fix(f"{what} contains NaN or +inf; it would poison every later activation.",
                            f"clean it first, e.g. torch.nan_to_num({what})."))
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(flat.view(torch.uint8).numpy())  # the buffer itself, not a bytes copy
    return t, h.hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class TensorData:
    """A tensor that compares and hashes by content (dtype, shape, bytes)."""

    tensor: torch.Tensor = field(compare=False, repr=False)
    digest: str = ""

    def __post_init__(self):
        """Checked here, not only in `of`: a `TensorData(...)` built directly reaches the forward pass (and a
        vLLM worker) too. The digest is always computed, never taken from the caller: specs hash and compare by
        it, and the vLLM driver reuses a serialised table by it."""
        t, digest = _checked(self.tensor, "a spec tensor")
        object.__setattr__(self, "tensor", t)
        object.__setattr__(self, "digest", digest)

    @classmethod
    def of(cls, value: Any, *, what: str) -> "TensorData":
        if isinstance(value, TensorData):
            return value
        return cls._trusted(*_checked(value, what))

    @classmethod
    def _trusted(cls, tensor: torch.Tensor, digest: str) -> "TensorData":
        """A tensor already checked: by `_checked`, or by the sending process (a vLLM worker's table)."""
        out = object.__new__(cls)
        object.__setattr__(out, "tensor", tensor)
        object.__setattr__(out, "digest", digest)
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def to_dict(self) -> dict[str, Any]:
        raw = self.tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        return {"dtype": str(self.tensor.dtype).removeprefix("torch."), "shape": list(self.shape),
                "data": base64.b64encode(raw).decode("ascii")}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, what: str, digest: str | None = None) -> "TensorData":
        """Rebuild a tensor from `to_dict` output, checking its dtype name, shape and size. With `digest` (a
        table the driver validated already: see `Spec.from_validated_dict`) the value checks and the content
        hash are skipped and `digest` is the tensor's identity."""
        remedy = "pass the {dtype, shape, data} dict that Spec.to_dict() wrote, unchanged."
        if not isinstance(d, Mapping) or not {"dtype", "shape", "data"} <= set(d):
            raise SpecError(fix(f"{what} is not a tensor dict (dtype, shape, data).", remedy))
        if len(d) != 3:
            extra = sorted(shown(k) for k in d if k not in ("dtype", "shape", "data"))
            raise SpecError(fix(f"{what} has unknown keys {', '.join(extra)}; a tensor dict holds dtype, shape and "
                                "data only.", remedy))
        # A fixed table, not getattr(torch, name): a name read from a file never reaches an attribute lookup.
        dtype = SPEC_DTYPES.get(d["dtype"]) if isinstance(d["dtype"], str) else None
        if dtype is None:
            raise SpecError(fix(f"{what}: tensor dtype {shown(d['dtype'])} is not one a spec holds.",
                                'use "float32", "float16", "bfloat16" or "float64" (float8 vectors: store them as '
                                'float32; they are cast to the model dtype at run time).'))
        shape, data = d["shape"], d["data"]
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= MAX_INDEX for s in shape):
            raise SpecError(fix(f"{what}: shape {shown(shape)} is not a list of at most {MAX_NDIM} sizes in "
                                f"0..{MAX_INDEX}.", remedy))
        if not isinstance(data, str):
            raise SpecError(fix(f"{what}: data is a {type(data).__name__}, not a base64 string.", remedy))
        size = dtype.itemsize
        for s in shape:
            size *= s
        # Checked before decoding: a payload of the wrong length never costs its decoded size in memory.
        if len(data) != 4 * -(-size // 3):
            raise SpecError(fix(f"{what}: {len(data)} base64 characters, but shape {shape} of {d['dtype']} is {size} "
                                f"bytes ({4 * -(-size // 3)} characters).", remedy))
        raw = torch.empty(size, dtype=torch.uint8)
        out, at = raw.numpy(), 0
        try:
            for i in range(0, len(data), _CHUNK):
                piece = binascii.a2b_base64(data[i:i + _CHUNK], strict_mode=True)
                if at + len(piece) > size:
                    raise ValueError("more bytes than the shape holds")
                out[at:at + len(piece)] = memoryview(piece)
                at += len(piece)
            if at != size:
                raise ValueError(f"{at} bytes of data for {size}")
        except (ValueError, TypeError) as e:
            raise SpecError(fix(f"{what}: data is not the base64 of {size} bytes ({e}).", remedy)) from None
        t = raw.view(dtype).reshape(shape)  # `raw` is this tensor's own buffer: no copy needed
        if digest is not None:
            return cls._trusted(t, digest)
        return cls.of(t, what=what)
