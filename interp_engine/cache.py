"""The Cache: activations at addresses, right-padded across a ragged batch, with each prompt's length."""

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from interp_engine import cache_helpers
from interp_engine.addresses import Address
from interp_engine.errors import PointError, fix
from interp_engine.sae import Features, TopFeatures


@dataclass(frozen=True)
class Cache(Mapping):
    """`cache[Address("resid_post", 3)]` or `cache["resid_post.3"]` -> a tensor in the point's axes, typed
    `typing.activation(address.info.axes)` (resid_post: `Resid`, Float[Tensor, "batch pos d_model"]). A pure
    function's Cache is checked against those types, sizes bound to the model, before it is returned.

    Rows are prompts; positions past a prompt's length (`lengths[i]`) are padding, filled with zeros.
    """

    tensors: Mapping[Address | Features, torch.Tensor | TopFeatures]
    lengths: tuple[int, ...]
    n_layers: int
    model_name: str = ""

    def __post_init__(self):
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

    def _key(self, key: "str | Address | Features") -> "Address | Features":
        if isinstance(key, Features):
            if key not in self.tensors:
                raise PointError(fix(f"this cache holds no {key}.", "capture it: capture(model, tokens, [sae.features])."))
            return key
        address = Address.parse(key).resolve(self.n_layers, model_name=self.model_name)
        if address not in self.tensors:
            held = ", ".join(map(str, self.tensors)) or "nothing"
            raise PointError(fix(f"this cache holds no {address}; it holds {held}.",
                                 f"capture it: capture(model, tokens, [{str(address)!r}])."))
        return address

    def __getitem__(self, key: "str | Address | Features") -> "torch.Tensor | TopFeatures":
        return self.tensors[self._key(key)]

    def get_tensor(self, key: "str | Address") -> torch.Tensor:
        return self[key]

    def __iter__(self) -> Iterator[Address]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, key: object) -> bool:
        try:
            self._key(key)  # type: ignore[arg-type]
        except (PointError, TypeError):
            return False
        return True

    def unpadded(self, key: "str | Address") -> list[torch.Tensor]:
        """One tensor per prompt, cut to that prompt's length (both axes for attention patterns)."""
        address = self._key(key)
        t = self.tensors[address]
        if isinstance(t, TopFeatures):
            return [TopFeatures(t.values[i, :n], t.indices[i, :n]) for i, n in enumerate(self.lengths)]
        if address.info.pos_axis == 2:
            return [t[i, :, :n, :n] for i, n in enumerate(self.lengths)]
        return [t[i, :n] for i, n in enumerate(self.lengths)]

    # TransformerLens's ActivationCache helpers, as methods (cache_helpers.py says what each means).
    accumulated_resid = cache_helpers.accumulated_resid
    decompose_resid = cache_helpers.decompose_resid
    stack_activation = cache_helpers.stack_activation
    apply_ln_to_stack = cache_helpers.apply_ln_to_stack
    logit_attrs = cache_helpers.logit_attrs

    def to(self, device: "str | torch.device | None" = None, dtype: "torch.dtype | None" = None) -> "Cache":
        """The same cache on another device or in another dtype (a new Cache; this one is unchanged)."""
        if device is None and dtype is None:
            return self
        return Cache({a: TopFeatures(t.values.to(device=device, dtype=dtype), t.indices.to(device=device))
                      if isinstance(t, TopFeatures) else t.to(device=device, dtype=dtype)
                      for a, t in self.tensors.items()}, self.lengths, self.n_layers, self.model_name)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{a}: {tuple(t.shape)}" for a, t in self.tensors.items())
        return f"Cache({shapes}; lengths={list(self.lengths)})"
