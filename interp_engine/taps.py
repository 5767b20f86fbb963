"""The taps a `vllm-static` engine is compiled with: which points it reads, which it writes, where an SAE
feature clamp is compiled in (`clamps`: declared with an SAE in static_writes; backends/vllm/static_clamp.py) and
which SAEs' whole encode is (`splices`: declared as S.Splice(sae), or bare when topk or normalised; their Splices
and Clamps, backends/vllm/static_splice.py). `sae_taps.py` reads the SAEs out of static_writes.

They are fixed at load (they are part of the compiled graph), so every request is checked against them before
it reaches the engine. Plain data: no torch, no vLLM.
"""

from dataclasses import dataclass
from typing import Any

from interp_engine.addresses import Address
from interp_engine.errors import BackendError, SpecError, fix

PATTERNS = ("attn_scores", "attn_probs")
# Always tapped: steer() and generate() read logits, which vLLM computes only at sampled rows, so every
# engine keeps the final norm's output and the unembedding runs on it after the step.
ALWAYS = (Address("final"), Address("logits"))
CLAMP_SLOTS = 64  # distinct (SAE, feature) pairs a compiled clamp holds per step, over all the step's calls
# Reads recomputed after the step from other points' tapped rows, as the vllm backend recomputes them in its
# hooks (backends/vllm/derived.py, experts.py): expert_weights from the router's logits, attn_result from z and
# o_proj, expert_out from the router's logits and resid_mid (the experts' input is its norm's output).
DERIVED = {"expert_weights": ("router_logits",), "attn_result": ("z",), "expert_out": ("router_logits", "resid_mid")}


def declare(points: Any, n_layers: int, *, keyword: str) -> tuple[Address, ...]:
    """`"auto"` (resid_post at every layer), a list of addresses, or None (nothing)."""
    if points is None:
        return ()
    if points == "auto":
        return tuple(Address("resid_post", layer) for layer in range(n_layers))
    if isinstance(points, str | Address) or not hasattr(points, "__iter__"):
        auto = f' or {keyword}="auto"' if keyword == "static_points" else ""
        raise SpecError(fix(f"{keyword}={points!r} is neither a list of points nor \"auto\".",
                            f'write {keyword}=["resid_post.10"]{auto}.'))
    return tuple(dict.fromkeys(Address.parse(p).resolve(n_layers) for p in points))


@dataclass(frozen=True, slots=True)
class DeclaredSAE:
    """An SAE declared at load, as the compiled splice needs it: its identity (`SAE.key`), point, settings and
    tensor shapes; not its weights, which fill the splice's buffers from the first call that splices with it."""

    key: str
    reads: Address
    settings: tuple  # ((name, value), ...): activation, k, normalize, apply_b_dec_to_input
    tensors: tuple  # ((name, shape, dtype), ...)

    def to_config(self) -> dict:
        return {"key": self.key, "reads": str(self.reads), "settings": dict(self.settings),
                "tensors": [[n, list(shape), dtype] for n, shape, dtype in self.tensors]}

    @classmethod
    def from_config(cls, d: dict) -> "DeclaredSAE":
        return cls(d["key"], Address.parse(d["reads"]), tuple(d["settings"].items()),
                   tuple((n, tuple(shape), dtype) for n, shape, dtype in d["tensors"]))


@dataclass(frozen=True, slots=True)
class Taps:
    reads: tuple[Address, ...]
    writes: tuple[Address, ...]
    clamps: tuple[Address, ...] = ()  # also in writes
    splices: tuple[DeclaredSAE, ...] = ()  # each at one of clamps: the SAEs whose whole encode is compiled in

    @classmethod
    def of(cls, static_points: Any, static_writes: Any, n_layers: int, clamps: tuple[Address, ...] = (),
           splices: tuple[DeclaredSAE, ...] = ()) -> "Taps":
        reads = declare(static_points, n_layers, keyword="static_points")
        writes = tuple(dict.fromkeys((*declare(static_writes, n_layers, keyword="static_writes"), *clamps)))
        eager_only = [str(a) for a in writes if a.info.eager_only_write or a.info.read_only or a.info.eager_only_read]
        if eager_only:
            raise SpecError(fix(f"static_writes={eager_only}: these points can be written only on the eager backend.",
                                "drop them from static_writes; edit them with backend=\"eager\"."))
        eager_reads = [str(a) for a in reads if a.info.eager_only_read]
        if eager_reads:
            raise SpecError(fix(f"static_points={eager_reads}: these points are read on the eager backend only "
                                "(vLLM's fused kernels never form them).",
                                "drop them from static_points; read them with backend=\"eager\"."))
        return cls(tuple(a for a in reads if a not in ALWAYS), writes, tuple(dict.fromkeys(clamps)),
                   tuple({s.key: s for s in splices}.values()))

    def buffers(self) -> tuple[Address, ...]:
        """The points that get a read buffer: the declared reads, the final norm's output (logits come from
        it), for an attention pattern its layer's q and k (the pattern is recomputed from them), and for a
        DERIVED read the points it is recomputed from."""
        out = {a for a in self.reads if a.point not in PATTERNS and a not in ALWAYS} | {ALWAYS[0]}
        out |= {Address(p, a.layer) for a in self.reads if a.point in PATTERNS for p in ("q", "k")}
        out = {s for a in out for s in ([Address(p, a.layer) for p in DERIVED[a.point]] if a.point in DERIVED else [a])}
        return tuple(sorted(out))

    def readable(self) -> tuple[Address, ...]:
        return (*self.reads, *ALWAYS)

    def refusal(self, address: Address, *, write: bool) -> BackendError | None:
        """Why this engine cannot serve `address` (None: it can)."""
        declared = self.writes if write else self.readable()
        if address in declared:
            return None
        what, keyword = ("written", "static_writes") if write else ("read", "static_points")
        listed = ", ".join(map(str, declared)) or "none"
        return BackendError(fix(
            f"{address} is not {what} by this vllm-static engine: its {keyword} are [{listed}]. Taps are compiled "
            "into the model at load, so a different set is a reload.",
            f'load_model(..., backend="vllm-static", {keyword}=[..., "{address}"]), or use backend="vllm", which '
            "serves any point per request."))

    def to_config(self) -> dict:
        return {"reads": [str(a) for a in self.reads], "writes": [str(a) for a in self.writes],
                "clamps": [str(a) for a in self.clamps], "splices": [s.to_config() for s in self.splices]}

    @classmethod
    def from_config(cls, d: dict) -> "Taps":
        return cls(*(tuple(map(Address.parse, d[k])) for k in ("reads", "writes", "clamps")),
                   tuple(map(DeclaredSAE.from_config, d["splices"])))
