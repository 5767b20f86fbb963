"""The validator's workload: the same prompts, edits, lens points and generation on every backend.

Everything here is a deterministic function of the model's dims, so each backend's subprocess rebuilds the same
cases and the driver compares them key by key.
"""

from collections.abc import Collection
from dataclasses import dataclass

import torch

from interp_engine import Address
from interp_engine import spec as S
from interp_engine.addresses import POINTS
from interp_engine.arch import Dims
from interp_engine.arch.layers import lacking
from interp_engine.validate import feature_shape

# Ragged on purpose: rows of different lengths exercise per-request row mapping and padding on every backend.
PROMPTS = ("Hello, world! Tell me a story", "Paris is the capital of", "The quick brown fox jumps over the lazy dog.")

# Ops the vLLM backends refuse by design (eager-only): listed as "not served", never counted as failures.
EAGER_ONLY_WRITES = tuple(name for name, info in POINTS.items() if info.eager_only_write)


@dataclass(frozen=True, slots=True)
class SteerCase:
    key: str  # "Add/resid_post.1"
    op: str
    address: Address
    spec: S.Spec

    @property
    def eager_only(self) -> bool:
        """True where the vLLM backends refuse this edit by design."""
        return self.address.point in EAGER_ONLY_WRITES or self.op == "Ablate(mean)"


def has_point(name: str, served: Collection[str]) -> bool:
    """`served`: the point names the model's arch has (`served_points`: MoE or dense points, a discovered model's
    residual stream; per layer, `arch.layers.lacking` says more). A Gated DeltaNet's lin_q ... are read on eager
    only: `eager_only_reads` asks them of every backend."""
    return not POINTS[name].eager_only_read and name in served


def served_points(arch) -> tuple[str, ...]:
    """The point names the model's arch has (a discovered model: the residual stream; MoE or dense points)."""
    return tuple(name for name in POINTS if arch.serves(name) and not arch.lacks(name))


def eager_only_reads(dims: Dims, served: Collection[str]) -> list[Address]:
    """The points only eager reads (vLLM's fused kernels never form them), at the middle layer: a backend that
    refuses one must do so before any request, which the report lists as not served; one that serves it is
    compared with eager."""
    return [Address(name, point_layer(name, dims)) for name, info in POINTS.items()
            if info.eager_only_read and name in served and point_layer(name, dims) is not None]


def steer_layer(dims: Dims) -> int:
    return dims.n_layers // 2


def point_layer(name: str, dims: Dims) -> int | None:
    """The middle layer; for a point the middle layer lacks (DeepSeek's dense-only mlp_act, a hybrid's
    linear-attention points), the layer nearest it that has it; None where no layer has it."""
    middle = steer_layer(dims)
    have = [i for i in range(dims.n_layers) if lacking(name, i, dims.layer_kinds) is None]
    return min(have, key=lambda i: (abs(i - middle), i), default=None)


def _vector(address: Address, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    seed = sum(ord(c) for c in str(address)) * 31 + salt
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.5


def steer_cases(dims: Dims, served: Collection[str]) -> list[SteerCase]:
    """Add, Set (last position) and zero-Ablate at every point of docs/design.md section 2, at the middle layer
    (a point it lacks: at the nearest layer that has it, `point_layer`).

    Attention patterns and logits are writable on eager only: one zero-Ablate each stands for them, plus a
    mean-Ablate (eager-only too), so the report lists what the vLLM backends do not serve.
    """
    cases = []
    for name, info in POINTS.items():
        layer = point_layer(name, dims)
        if not has_point(name, served) or info.read_only or layer is None:
            continue
        address = Address(name, layer) if info.layered else Address(name)
        if info.eager_only_write:
            cases.append(SteerCase(f"Ablate/{address}", "Ablate", address, S.Spec((S.Ablate(str(address)),))))
            continue
        shape = feature_shape(address, dims, 1)
        cases += [
            SteerCase(f"Add/{address}", "Add", address,
                      S.Spec((S.Add(str(address), _vector(address, shape, 1), scale=2.0),))),
            SteerCase(f"Set/{address}", "Set", address,
                      S.Spec((S.Set(str(address), _vector(address, shape, 2), positions="last"),))),
            SteerCase(f"Ablate/{address}", "Ablate", address, S.Spec((S.Ablate(str(address)),))),
        ]
    mean = Address("resid_post", layer)
    cases.append(SteerCase(f"Ablate(mean)/{mean}", "Ablate(mean)", mean, S.Spec((S.Ablate(str(mean), how="mean"),))))
    return cases


def route_cases(dims: Dims) -> list[tuple[str, S.Spec]]:
    """MoE only: the experts chosen (expert_weights, zero where not chosen) under each router_logits edit of
    steer_cases, and under Scale(-1), which makes every token take its least likely experts. Equal to eager
    within tolerance means the same experts chosen with the same weights: another choice is off by a weight."""
    if not dims.n_experts:
        return []
    router = Address("router_logits", point_layer("router_logits", dims))
    edits = [(c.op, c.spec) for c in steer_cases(dims, ("router_logits",)) if c.address == router]
    edits.append(("Scale(-1)", S.Spec((S.Scale(str(router), -1.0),))))
    return [(f"route/{op}/{route_read(dims)}", spec) for op, spec in edits]


def route_read(dims: Dims) -> Address:
    return Address("expert_weights", point_layer("expert_weights", dims))


def router_reads(dims: Dims) -> list[Address]:
    """The router logits at every layer: read beside each forward of a family whose tolerance has `near_tie`
    (tolerances.py), to tell which prompts chose other experts than eager, and at what margin."""
    return [Address("router_logits", i) for i in range(dims.n_layers)] if dims.n_experts else []


def lens_points(dims: Dims, served: Collection[str] | None = None) -> list[Address]:
    layer = steer_layer(dims)
    every = [Address("embed"), *(Address("resid_post", i) for i in range(dims.n_layers)),
             Address("resid_mid", layer), Address("attn_out", layer), Address("mlp_out", layer), Address("final")]
    return [a for a in every if served is None or a.point in served]


def generation_spec(dims: Dims) -> S.Spec:
    address = Address("resid_post", steer_layer(dims))
    return S.Spec((S.Add(str(address), _vector(address, (dims.d_model,), 3), scale=4.0),))


def generation_capture(dims: Dims) -> list[str]:
    return [f"resid_post.{dims.n_layers - 1}"]


@dataclass(frozen=True, slots=True)
class Plant:
    """A deliberate error, for proving the validator catches one: `amount` added to one captured point on one
    backend (optionally at one num_gpus) in that backend's subprocess, after the capture and before comparing.
    Only the explicit --plant flag creates one, and every report made with it says so."""

    address: Address
    backend: str
    amount: float
    num_gpus: int | None = None

    @classmethod
    def parse(cls, text: str) -> "Plant":
        """"resid_mid.1:vllm:1e-2" or "resid_mid.1:vllm@2:1e-2"."""
        try:
            where, backend, amount = text.split(":")
            backend, _, ranks = backend.partition("@")
            plant = cls(Address.parse(where), backend, float(amount), int(ranks) if ranks else None)
        except ValueError as e:
            raise ValueError(f"--plant {text!r} is not POINT.LAYER:BACKEND[@NUM_GPUS]:AMOUNT ({e}). "
                             "Fix: e.g. --plant resid_mid.1:vllm:1e-2") from None
        if not plant.amount or plant.amount != plant.amount:
            raise ValueError(f"--plant amount must be a non-zero number, got {amount!r}. Fix: e.g. 1e-2.")
        return plant

    def applies(self, backend: str, num_gpus: int) -> bool:
        return backend == self.backend and self.num_gpus in (None, num_gpus)

    def __str__(self) -> str:
        ranks = f"@{self.num_gpus}" if self.num_gpus else ""
        return f"{self.address}:{self.backend}{ranks}:{self.amount:g}"
