"""The backend contract: what every runtime does (`Runtime`), what each backend serves (`Capabilities`), and the
tokenizer side every runtime shares.

Code outside `interp_engine/backends/` and `selection.py` never compares backend names: it asks a handle's
`capabilities` (or, before loading, `interp_engine.backends.capabilities(name)`).
"""

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.errors import BackendError, fix
from interp_engine.inputs import Prompts
from interp_engine.taps import Taps
from interp_engine.validate import Plan
from interp_engine.weights import Weights

# The pure functions a backend may serve.
VERBS = ("capture", "steer", "generate", "logit_lens", "run_with_grad")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend serves. The registry holds one per backend (`interp_engine.backends.REGISTRY`); a loaded
    handle holds its own (`model.capabilities`), narrowed by its attention implementation or declared taps."""

    backend: str  # the name load_model takes
    verbs: frozenset[str]  # the pure functions it serves (VERBS)
    points: bool  # reads or writes any point at all (False: plain generation)
    patterns: bool  # attn_scores and attn_probs are readable
    eager_only_writes: bool  # attn_scores, attn_probs and logits are writable (points with eager_only_write)
    mean_ablation: bool  # Ablate(how="mean"): the call's batch is one forward, so its mean is defined
    custom_ops: bool  # Custom: a Python function runs where the activations are
    gradients: bool  # run_with_grad: autograd through the forward (requires_grad=True at load)
    quantization: frozenset[str]  # schemes it applies on load (quantization.py says how)
    vllm_engine: bool  # a vLLM engine: kv_cache_dtype, gpu_memory_utilization, max_model_len, extra_vllm_kwargs
    declares_taps: bool  # points are compiled in at load: static_points= and static_writes=
    # Clamp and Splice with any SAE at any point (an SAE encodes where the activations are); False: only the Clamps
    # and Splices compiled in at load (`Taps.clamps`, `Taps.splices`)
    feature_edits: bool = True
    fixed_engine_args: tuple[str, ...] = ()  # extra_vllm_kwargs it sets itself, refused from the user ...
    fixed_because: str = ""  # ... because of this
    fixed_instead: str = ""  # ... and what to do instead, after "drop them"
    attn_implementation: str | None = None  # per handle, HF attention on eager (None: the backend's own kernels)
    taps: Taps | None = None  # per handle, on a backend that declares taps: the declared points
    served: frozenset[str] | None = None  # per handle, the points its architecture has (None: every point)
    # Points served for reading only on this backend though they are written on eager (DeepSeek's k and v on vLLM),
    # and why.
    read_only: frozenset[str] = frozenset()
    read_only_why: str = ""
    eager_only_reads: bool = False  # points with eager_only_read are readable (a Gated DeltaNet's lin_q ...)

    def serves(self, verb: str) -> bool:
        return verb in self.verbs

    def can_read(self, address: Address) -> bool:
        """Whether a resolved address is readable on this handle (what `validate.plan` accepts)."""
        return (self.points and (self.patterns or not address.info.needs_eager_attention)
                and (self.eager_only_reads or not address.info.eager_only_read)
                and (self.served is None or address.point in self.served)
                and (self.taps is None or address in self.taps.readable()))

    def can_write(self, address: Address) -> bool:
        """Whether a resolved address is writable on this handle (what `validate.plan` accepts for an Add)."""
        return (self.points and (self.patterns or not address.info.needs_eager_attention)
                and (self.eager_only_writes or not address.info.eager_only_write) and not address.info.read_only
                and (self.served is None or address.point in self.served) and address.point not in self.read_only
                and (self.taps is None or address in self.taps.writes))


@runtime_checkable
class Runtime(Protocol):
    """What a handle calls on its backend. The tokenizer side works before `load()`; everything else loads lazily.

    `forward`, `stream` and `lens` take a validated `Plan` and return points as `capture` lays them out
    ([batch, pos, ...], zeros at padding); `generate` returns the new ids per prompt and the points read."""

    capabilities: Capabilities

    @property
    def is_loaded(self) -> bool: ...

    def load(self) -> Any: ...

    def unload(self) -> None: ...

    def calling(self) -> contextlib.AbstractContextManager:
        """A public call's span on its thread: a call that began before `unload()` must not load again."""
        ...

    def tokenize(self, text: str, *, prepend_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def eos_id(self) -> int | None: ...

    def forward(self, prompts: Prompts, plan: Plan, *, batch_size: int, want_logits: bool,
                progress: bool = True, logits_at: Tensor | None = None
                ) -> tuple[Tensor | None, dict[Address, Tensor]]: ...
    # `logits_at`, [batch, n] positions of each prompt (positions.position_index): only those logits are kept.

    def stream(self, chunks: Iterable[tuple[Prompts, Plan]], *, batch_size: int
               ) -> Iterator[tuple[Prompts, dict[Address, Tensor]]]: ...

    def generate(self, prompts: Prompts, plan: Plan, *, max_new_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, seed: int | None, stop_at_eos: bool, batch_size: int,
                 progress: bool = True) -> tuple[list[list[int]], dict[Address, Tensor]]: ...

    def lens(self, prompts: Prompts, plan: Plan, *, batch_size: int,
             progress: bool = True) -> dict[Address, Tensor]: ...

    def weights(self) -> Weights: ...


@runtime_checkable
class GradientRuntime(Runtime, Protocol):
    """A runtime whose capabilities say `gradients`: `run_with_grad` calls this."""

    def forward_with_grad(self, prompts: Prompts, plan: Plan, *, loss: Callable[[Tensor], Tensor],
                          wrt: tuple[Address, ...], shapes: Mapping[Address, tuple[int, ...]]
                          ) -> tuple[Tensor, dict[Address, Tensor]]: ...


class TokenizerRuntime:
    """Text <-> ids with the checkpoint's own tokenizer; BOS handled the same way on every backend."""

    tokenizer = None

    def calling(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # loading again under a running call is harmless where calls never wait

    def tokenize(self, text: str, *, prepend_bos: bool = True) -> list[int]:
        ids = list(self.tokenizer(text, add_special_tokens=True)["input_ids"])
        bos = self.tokenizer.bos_token_id
        if bos is not None:
            if prepend_bos and (not ids or ids[0] != bos):
                ids = [bos, *ids]
            elif not prepend_bos and ids and ids[0] == bos:
                ids = ids[1:]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @property
    def pad_id(self) -> int:
        for candidate in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0):
            if candidate is not None:
                return int(candidate)
        return 0

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def weights(self) -> Weights:
        """TransformerLens-shaped weights; a backend that can read its own overrides this refusal."""
        raise BackendError(fix(f"backend={self.capabilities.backend!r} does not hand out its weights yet: its "
                               "workers hold them, in their own (possibly sharded) layout.",
                               'load the same checkpoint with backend="eager" (device="cpu" needs no GPU) and read '
                               "model.weights there."))

    def stream(self, chunks: Iterable[tuple[Prompts, Plan]], *, batch_size: int
               ) -> Iterator[tuple[Prompts, dict[Address, torch.Tensor]]]:
        """Capture each chunk's reads, in order, as flat rows: [its total tokens, ...], prompt after prompt
        (what a harvest stores). Here one `forward` per chunk; the vLLM runtime overlaps the chunks."""
        for prompts, plan in chunks:
            _, records = self.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=False)
            yield prompts, {a: torch.cat([t[:n] for t, n in zip(records[a], prompts.lengths)]) for a in plan.reads}
