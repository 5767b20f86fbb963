"""Sparse autoencoders and transcoders as data: weights as content-addressed tensors (`TensorData`), the point
they read (and, for a transcoder, the point they write), the activation and the input normalisation. No model, no
backend: the same `SAE` encodes on the driver (feature reads) and inside an op (`spec.Clamp`, `spec.Splice`) in
any backend's worker (on vLLM sent once per engine and named by `SAE.key` in tables).
`load_sae(path)` (`sae_files.py`) reads them from disk.
"""

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from interp_engine.addresses import Address, PointInfo
from interp_engine.errors import SpecError, fix
from interp_engine.tensor_data import TensorData, is_index, shown

ACTIVATIONS = ("relu", "jumprelu", "topk")
NORMALISATIONS = ("none", "constant_norm_rescale", "layer_norm")
TENSORS = ("W_enc", "b_enc", "W_dec", "b_dec", "threshold")


@dataclass(frozen=True, slots=True)
class SAE:
    """`f = act((norm(x) - b_dec * apply_b_dec_to_input) @ W_enc + b_enc)`, `x_hat = denorm(f @ W_dec + b_dec)`.

    `W_enc` is (d_in, d_sae), `W_dec` (d_sae, d_out); `reads` is the point x comes from (its trailing axes
    flattened to d_in, so a `z` SAE reads n_heads * d_head). `writes` is set for a transcoder, whose
    reconstruction belongs to another point. `activation` is relu, jumprelu (needs `threshold`, one per feature)
    or topk (needs `k`). `normalize`: none, constant_norm_rescale (x scaled to norm sqrt(d_in), undone on the
    way out) or layer_norm, as SAELens names them."""

    W_enc: TensorData
    b_enc: TensorData
    W_dec: TensorData
    b_dec: TensorData
    reads: Address
    activation: str = "relu"
    threshold: TensorData | None = None
    k: int | None = None
    normalize: str = "none"
    apply_b_dec_to_input: bool = False
    writes: Address | None = None
    _key: str = field(default="", init=False, repr=False, compare=False)  # `key`, hashed once

    def __post_init__(self):
        problems = []
        for name in TENSORS:
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, TensorData.of(value, what=f"SAE.{name}"))
        # TensorData refuses NaN and +inf; -inf (a masked score in an attn_scores edit) has no place in an SAE.
        infinite = [f"SAE.{name}" for name in TENSORS if (t := getattr(self, name)) is not None
                    and any(bool(c.isneginf().any()) for c in t.tensor.reshape(-1).split(1 << 22))]
        if infinite:
            problems.append(fix(f"{', '.join(infinite)} contains -inf: every activation the SAE encodes or decodes "
                                "would become -inf or NaN.", f"clean it first, e.g. torch.nan_to_num({infinite[0]})."))
        for name in ("reads", "writes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Address.parse(getattr(self, name)))
        enc, dec = self.W_enc.shape, self.W_dec.shape
        if len(enc) != 2 or len(dec) != 2 or enc[1] != dec[0]:
            problems.append(fix(f"SAE weights W_enc {enc} and W_dec {dec} do not agree.",
                                "W_enc is (d_in, d_sae) and W_dec is (d_sae, d_out), as SAELens saves them."))
        else:
            d_in, d_sae, d_out = enc[0], enc[1], dec[1]
            for name, want in (("b_enc", d_sae), ("b_dec", d_out), ("threshold", d_sae)):
                value = getattr(self, name)
                if value is not None and value.shape != (want,):
                    problems.append(fix(f"SAE.{name} has shape {value.shape}, not ({want},).",
                                        f"pass {name} with one entry per {'feature' if want == d_sae else 'output'}."))
            if self.apply_b_dec_to_input and d_in != d_out:
                problems.append(fix("apply_b_dec_to_input subtracts b_dec from the input, but d_in != d_out.",
                                    "set apply_b_dec_to_input=False for a transcoder."))
            if self.writes is None and d_in != d_out:
                problems.append(fix(f"this SAE reads {d_in} and writes {d_out} values: a transcoder.",
                                    "name the point it writes: SAE(..., writes=Address('mlp_out', L))."))
            if self.activation == "topk" and not (isinstance(self.k, int) and not isinstance(self.k, bool)
                                                  and 1 <= self.k <= d_sae):
                problems.append(fix(f"activation topk needs k in 1..{d_sae}, got k={shown(self.k)}.",
                                    "pass k=, e.g. SAE(..., activation='topk', k=32)."))
        if self.activation not in ACTIVATIONS:
            problems.append(fix(f"activation {shown(self.activation)} is not one an SAE here has.",
                                f"use one of {', '.join(ACTIVATIONS)} (topk with k=)."))
        if self.activation == "jumprelu" and self.threshold is None:
            problems.append(fix("activation jumprelu needs a threshold per feature, and none was given.",
                                "pass threshold= (Gemma Scope's params.npz and SAELens's jumprelu weights hold it)."))
        if self.normalize not in NORMALISATIONS:
            problems.append(fix(f"normalize={shown(self.normalize)} is not a normalisation served here.",
                                f"use one of {', '.join(NORMALISATIONS)}; for expected_average_only_in fold the "
                                "scaling factor into the weights (SAELens: fold_activation_norm_scaling_factor)."))
        if problems:
            raise SpecError(problems[0] if len(problems) == 1 else
                            f"{len(problems)} problems with this SAE:\n" +
                            "\n".join(f"{i}. {p}" for i, p in enumerate(problems, 1)))
        # A compiled clamp names its SAEs by key before every step: hashed here once, not per step.
        key = hashlib.sha256(json.dumps(self.encoded(lambda t: t.digest), sort_keys=True).encode()).hexdigest()[:32]
        object.__setattr__(self, "_key", key)

    @property
    def d_in(self) -> int:
        return self.W_enc.shape[0]

    @property
    def d_sae(self) -> int:
        return self.W_enc.shape[1]

    @property
    def d_out(self) -> int:
        return self.W_dec.shape[1]

    @property
    def features(self) -> "Features":
        """What `capture` reads for this SAE's feature activations: `cache[sae.features]` is (batch, pos, d_sae)."""
        return Features(self)

    def top_features(self, k: int) -> "Features":
        """The sparse read of a wide SAE: `cache[sae.top_features(k)]` is a `TopFeatures` (values, indices), each
        (batch, pos, k), `torch.topk(dense, k)` of the dense features. Ties come in torch.topk's order: where fewer
        than k fire, the trailing values are 0 and their indices name some features that did not fire."""
        if k is None:  # Features(sae, None) is the dense read: not what a call for the top k means
            raise _bad_k(k, self.d_sae)
        return Features(self, top_k=k)

    @property
    def key(self) -> str:
        """The SAE by content (its tensors' digests and its settings): how workers and compiled taps name it."""
        return self._key

    def weights(self, device: torch.device) -> dict[str, Tensor]:
        """The tensors `encode`, `decode` and `spliced` compute with unless given `w` (a compiled tap's buffers)."""
        return {name: on_device(getattr(self, name), device) for name in TENSORS if getattr(self, name) is not None}

    def encode(self, x: Tensor, w: Mapping[str, Tensor] | None = None) -> Tensor:
        """Feature activations of `x` (..., d_in), in the SAE's dtype."""
        w = w or self.weights(x.device)
        return self._act(self._pre(self._norm_in(x)[0], w), w)

    def decode(self, f: Tensor, x: Tensor, w: Mapping[str, Tensor] | None = None) -> Tensor:
        """The reconstruction of `x` from features `f` (normalisation undone with x's own statistics)."""
        w = w or self.weights(f.device)
        return self._norm_out(f @ w["W_dec"] + w["b_dec"], self._norm_in(x)[1])

    def clamped(self, x: Tensor, features: tuple[int, ...], value: float) -> Tensor:
        """`x` (..., d_in) with `features` set to `value` and the error term kept: only their decoder rows move."""
        normed, stats = self._norm_in(x)
        idx, w = torch.tensor(features, device=x.device), self.weights(x.device)
        if self.activation == "topk":  # whether a feature is in the top k depends on every feature
            f = self._act(self._pre(normed, w), w).index_select(-1, idx)
        else:  # relu and jumprelu act per feature: only the clamped columns are encoded
            f = self._act(self._pre(normed, w, idx), w, idx)
        return self._moved(x, (value - f) @ w["W_dec"].index_select(0, idx), stats)

    def clamped_per_row(self, x: Tensor, idx: Tensor, count: Tensor, target: Tensor,
                        w: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        """`clamped` as a compiled tap runs it, every row at once from one whole encode, and the reconstruction
        from that same encode (`spliced` without error). Row r moves by `sum_j count[r, j] * (target[r, j] -
        f_idx[j](x_r)) * W_dec[idx[j]]`: x (n, d_in), idx (slots,), count and target (n, slots)."""
        normed, stats = self._norm_in(x)
        f = self._act(self._pre(normed, w), w)
        x_hat = self._norm_out(f @ w["W_dec"] + w["b_dec"], stats).to(x.dtype)
        delta = (count * (target - f.index_select(-1, idx))) @ w["W_dec"].index_select(0, idx)
        return self._moved(x, delta, stats), x_hat

    @property
    def acts_per_feature(self) -> bool:
        """Whether one feature's activation needs only its own encoder column: relu and jumprelu, unnormalised
        (topk asks whether it is in the row's top k; a normalisation, the row's own scale)."""
        return self.activation != "topk" and self.normalize == "none"

    def spliced(self, x: Tensor, error: bool, w: Mapping[str, Tensor] | None = None) -> Tensor:
        """`x` (..., d_in) replaced by its reconstruction; with `error`, plus `x - x_hat` held constant."""
        x_hat = self.decode(self.encode(x, w), x, w).to(x.dtype)
        return x_hat + (x - x_hat).detach() if error else x_hat

    def _norm_in(self, x: Tensor) -> tuple[Tensor, tuple]:
        x = x.to(self.W_enc.tensor.dtype)
        if self.normalize == "constant_norm_rescale":
            # A zero vector (padding) stays zero rather than NaN.
            coeff = self.d_in ** 0.5 / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
            return x * coeff, (coeff,)
        if self.normalize == "layer_norm":
            mu = x.mean(-1, keepdim=True)
            std = (x - mu).std(-1, keepdim=True)
            return (x - mu) / (std + 1e-5), (mu, std)
        return x, ()

    def _moved(self, x: Tensor, delta: Tensor, stats: tuple) -> Tensor:
        """x plus a move `delta` made in the SAE's normalised space."""
        if self.normalize == "constant_norm_rescale":
            delta = delta / stats[0]
        elif self.normalize == "layer_norm":
            delta = delta * stats[1]
        return x + delta.to(x.dtype)

    def _norm_out(self, y: Tensor, stats: tuple) -> Tensor:
        if self.normalize == "constant_norm_rescale":
            return y / stats[0]
        if self.normalize == "layer_norm":
            return y * stats[1] + stats[0]
        return y

    def _pre(self, x: Tensor, w: Mapping[str, Tensor], idx: Tensor | None = None) -> Tensor:
        if self.apply_b_dec_to_input:
            x = x - w["b_dec"]
        enc, b = w["W_enc"], w["b_enc"]
        return x @ enc + b if idx is None else x @ enc.index_select(1, idx) + b.index_select(0, idx)

    def _act(self, pre: Tensor, w: Mapping[str, Tensor], idx: Tensor | None = None) -> Tensor:
        if self.activation == "topk":
            top = pre.topk(self.k, dim=-1)
            return torch.zeros_like(pre).scatter(-1, top.indices, top.values.relu())
        f = pre.relu()
        if self.activation == "jumprelu":
            threshold = w["threshold"]
            f = f * (pre > (threshold if idx is None else threshold.index_select(0, idx))).to(f.dtype)
        return f

    def encoded(self, tensor: Callable[[TensorData], Any]) -> dict[str, Any]:
        """A JSON-ready dict, each tensor written by `tensor` (its bytes, or its digest for a fingerprint)."""
        out: dict[str, Any] = {name: tensor(getattr(self, name)) for name in TENSORS if getattr(self, name) is not None}
        out.update(reads=str(self.reads), writes=None if self.writes is None else str(self.writes),
                   activation=self.activation, k=self.k, normalize=self.normalize,
                   apply_b_dec_to_input=self.apply_b_dec_to_input)
        return out

    @classmethod
    def decoded(cls, d: Mapping[str, Any], *, what: str, digest: str | None = None) -> "SAE":
        """Rebuild from `encoded(TensorData.to_dict)`; with `digest` (a table the driver checked) tensors take
        `{digest}.{name}` as their identity and are not hashed again."""
        if not isinstance(d, Mapping):
            raise SpecError(fix(f"{what} is not an SAE dict.", "pass what Spec.to_dict() wrote, unchanged."))
        if set(d) == {"ref"}:  # an SAE sent to this process once (backends/vllm/sae_refs.py)
            if not isinstance(d["ref"], str) or d["ref"] not in KEPT:
                raise SpecError(fix(f"{what} names SAE {shown(d['ref'])}, which this process was never sent.",
                                    "send the SAE itself (Spec.to_dict() writes it whole)."))
            return KEPT[d["ref"]]
        known = {*TENSORS, "reads", "writes", "activation", "k", "normalize", "apply_b_dec_to_input"}
        if unknown := sorted(shown(k) for k in d if k not in known):
            raise SpecError(fix(f"{what} has unknown keys {', '.join(unknown)}.", f"an SAE dict holds {sorted(known)}."))
        kwargs = {k: v for k, v in d.items() if k not in TENSORS}
        for name in TENSORS:
            if name in d:
                kwargs[name] = TensorData.from_dict(d[name], what=f"{what}.{name}",
                                                    digest=None if digest is None else f"{digest}.{name}")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise SpecError(fix(f"{what} is malformed: {e}.", "pass what Spec.to_dict() wrote, unchanged.")) from None


class TopFeatures(NamedTuple):
    """A sparse feature read, in torch.topk's order (values, indices): values descending, both (batch, pos, k)."""

    values: Tensor
    indices: Tensor  # int64 feature indices

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


@dataclass(frozen=True, slots=True)
class Features:
    """A read of an SAE's feature activations, for `capture(model, x, [sae.features])`: the SAE's point is read
    and encoded in the caller's process (d_in values per position cross from a worker, not d_sae). With `top_k`
    (`sae.top_features(k)`) only each position's k largest are kept, encoded a slice of rows at a time, so the
    dense (batch, pos, d_sae) tensor is never whole."""

    sae: SAE
    top_k: int | None = None

    def __post_init__(self):
        if self.top_k is not None and not (is_index(self.top_k) and 1 <= self.top_k <= self.sae.d_sae):
            raise _bad_k(self.top_k, self.sae.d_sae)

    @property
    def info(self) -> PointInfo:
        return FEATURES if self.top_k is None else TOP_FEATURES

    def read(self, x: Tensor, valid: Tensor) -> "Tensor | TopFeatures":
        """This read of a point's activations `x` (batch, pos, d_in); positions not `valid` (padding) read as
        zero features."""
        if self.top_k is None:
            acts = self.sae.encode(x)
            return torch.where(valid[..., None].to(acts.device), acts, 0.0)
        rows, keep = x.reshape(-1, x.shape[-1]), valid.reshape(-1, 1).to(x.device)
        step = max(1, _TOP_CHUNK // self.sae.d_sae)
        parts = [torch.where(keep[i:i + step], self.sae.encode(rows[i:i + step]), 0.0).topk(self.top_k, dim=-1)
                 for i in range(0, len(rows), step)]
        shape = (*x.shape[:2], self.top_k)
        return TopFeatures(torch.cat([p.values for p in parts]).reshape(shape),
                           torch.cat([p.indices for p in parts]).reshape(shape))

    def __str__(self) -> str:
        which = "features" if self.top_k is None else f"top {self.top_k} features"
        return f"{which} of {self.sae.reads} (d_sae={self.sae.d_sae}, W_enc {self.sae.W_enc.digest[:8]})"


def _bad_k(k, d_sae: int) -> SpecError:
    return SpecError(fix(f"top_features(k) needs k in 1..{d_sae} (this SAE's features), got {shown(k)}.",
                         "pass a whole k, e.g. sae.top_features(32); sae.features reads them all."))


# SAEs a vLLM worker holds, by `SAE.key`, until the driver evicts them: tables name them by {"ref": key}.
KEPT: dict[str, SAE] = {}

FEATURES = PointInfo("features", ("batch", "pos", "d_sae"))
TOP_FEATURES = PointInfo("top_features", ("batch", "pos", "top_features"))
_TOP_CHUNK = 1 << 24  # dense features encoded at once by a sparse read: 64 MB of float32

# Weights moved to an accelerator once per (digest, device), not per step: a 16x SAE of a 4096-wide model is 1 GB
# (an evicted SAE's leave with it: sae_refs.keep).
ON_DEVICE: dict[tuple[str, str], Tensor] = {}


def on_device(t: TensorData, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return t.tensor
    key = (t.digest, str(device))
    if key not in ON_DEVICE:
        while len(ON_DEVICE) >= 16:
            ON_DEVICE.pop(next(iter(ON_DEVICE)))
        ON_DEVICE[key] = t.tensor.to(device)
    return ON_DEVICE[key]


def flat(x: Tensor) -> Tensor:
    """A point's activation (batch, pos, ...) with its trailing axes as one d_in axis."""
    return x.reshape(*x.shape[:2], -1)


# ---------------------------------------------------------------------------------------------------- loading
