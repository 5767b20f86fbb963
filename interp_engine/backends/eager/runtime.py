"""The eager backend: a HF transformers model, hooked per call, never changed between calls."""

import gc
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from interp_engine import allocator
from interp_engine.addresses import Address
from interp_engine.arch import Arch, Dims
from interp_engine.backends.base import TokenizerRuntime
from interp_engine.backends.eager import attention, linear_attention
from interp_engine.backends.eager.capabilities import for_handle
from interp_engine.edits import Step
from interp_engine.backends.eager.weights import read_weights
from interp_engine.backends.eager.layout import Layout
from interp_engine.backends.eager.run import Run
from interp_engine.backends.eager.sites import installed
from interp_engine.errors import LoadError, fix
from interp_engine.inputs import Prompts
from interp_engine.positions import at_positions
from interp_engine.progress import showing
from interp_engine.validate import Plan
from interp_engine.weights import Weights

LOGITS = Address("logits")


class EagerRuntime(TokenizerRuntime):
    """Holds the tokenizer from construction and the weights from `load()` until `unload()`."""

    def __init__(self, *, source: str | Path, arch: Arch, dims: Dims, device: str, dtype: torch.dtype,
                 attn_implementation: str, num_gpus: int, hf_kwargs: Mapping[str, Any], tokenizer):
        self.source, self.arch, self.dims = source, arch, dims
        self.device, self.dtype, self.attn_implementation = device, dtype, attn_implementation
        self.num_gpus, self.hf_kwargs, self.tokenizer = num_gpus, dict(hf_kwargs), tokenizer
        self.capabilities = for_handle(attn_implementation)
        self.model: torch.nn.Module | None = None
        self._weights: tuple[torch.nn.Module, Weights] | None = None  # read once per loaded model
        self.layout: Layout | None = None
        self._lock = threading.Lock()
        # Hooks live on the shared modules while a call runs, so calls on one handle take turns.
        self._busy = threading.RLock()

    # ----------------------------------------------------------------------------------------- lifecycle
    @property
    def is_loaded(self) -> bool:
        return self.model is not None

    def load(self) -> torch.nn.Module:
        with self._lock:
            if self.model is None:
                from transformers import AutoModelForCausalLM

                kwargs: dict[str, Any] = {"dtype": self.dtype, "attn_implementation": self.attn_implementation,
                                          "local_files_only": True, **self.hf_kwargs}
                if self.num_gpus > 1:
                    kwargs.setdefault("device_map", "auto")
                # A wrapper's text weights are read through a name mapping (arch/aliases.py): a layout it does not
                # know would leave them randomly initialised, which transformers only warns about.
                mapped = "key_mapping" in self.hf_kwargs
                try:
                    model = AutoModelForCausalLM.from_pretrained(str(self.source), output_loading_info=mapped,
                                                                 **kwargs)
                except OSError as e:
                    raise LoadError(fix(f"the weights of {str(self.source)!r} cannot be loaded: {e}",
                                        "check the folder holds the *.safetensors (or *.bin) files that "
                                        "save_pretrained() wrote, or that the repo is fully in the HF cache.")
                                    ) from None
                if mapped:
                    model, info = model
                    if missing := sorted(info["missing_keys"]):
                        raise LoadError(fix(
                            f"{str(self.source)!r} is a multimodal wrapper whose text weights were not found: "
                            f"{len(missing)} missing ({', '.join(missing[:3])}, ...) under the names read "
                            f"({', '.join(self.hf_kwargs['key_mapping'])}).",
                            "use the checkpoint as published (its text weights under language_model. or "
                            "model.language_model.), or save the text model on its own and load that."))
                if "device_map" not in kwargs:
                    model.to(self.device)
                    if torch.device(self.device).type == "cpu":
                        allocator.apply()  # else a capture's records push each call's activations onto fresh pages
                model.eval()
                model.requires_grad_(False)
                model.set_attn_implementation(attention.register(self.attn_implementation))
                if self.arch.linear_attention is not None:
                    linear_attention.register(model)
                self.layout = Layout.of(model, self.arch, self.dims, self.weights)
                self.model = model
            return self.model

    def unload(self) -> None:
        with self._lock:
            self.model, self.layout, self._weights = None, None, None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # ----------------------------------------------------------------------------------------- forward
    def _forward(self, ids: Tensor, step: Step, run: Run, **model_kwargs) -> Tensor:
        model = self.load()
        run.step = step
        if not run.wants(LOGITS):
            # Nobody reads or edits logits at every position: project only the last one (the full
            # [batch, pos, d_vocab] tensor would cost more than the whole model for a large vocabulary).
            model_kwargs.setdefault("logits_to_keep", 1)
        layout = self.layout if self.model is model else None  # unloaded meanwhile: this model's own
        with installed(layout or Layout.of(model, self.arch, self.dims, self.weights), run):
            out = model(input_ids=ids.to(self.device), **model_kwargs)
        return run.touch(LOGITS, out.logits) if run.wants(LOGITS) else out.logits

    def forward(self, prompts: Prompts, plan: Plan, *, batch_size: int, want_logits: bool,
                progress: bool = True, logits_at: Tensor | None = None) -> tuple[Tensor | None, dict[Address, Tensor]]:
        """Run every prompt (chunks of `batch_size`, right-padded); return logits and the recorded points."""
        chunks = prompts.chunks(batch_size)
        width = max(prompts.lengths)
        logits_parts, record_parts = [], {a: [] for a in plan.reads}
        reads = frozenset(plan.reads) | ({LOGITS} if want_logits else frozenset())
        # A disabled tqdm still costs ~50 us to build; most calls are one chunk.
        shown = showing(progress and len(chunks) > 1)
        bar = tqdm(chunks, desc="forward", unit="batch") if shown else chunks
        with self._busy, torch.inference_mode():
            for rows in bar:
                ids, lengths = prompts.right_padded(rows, self.pad_id)
                step = _step(ids, lengths, rows)
                run = Run(plan.ops, reads)
                logits = self._forward(ids, step, run, use_cache=False)
                # A chunk without padding (the common case) keeps each record as recorded: no pass over any of them.
                ragged = not bool(step.valid.all())
                for address, parts in record_parts.items():
                    seen = run.records[address][0]
                    parts.append(_pad(_zero_padding(seen, step, address) if ragged else seen, width, address))
                if want_logits and logits_at is not None:  # cut per chunk: the full logits never pile up
                    logits_parts.append(at_positions(logits, logits_at[list(rows)], dim=1))
                elif want_logits:
                    logits_parts.append(_pad(_zero_padding(logits, step, LOGITS), width, LOGITS))
        records = {a: p[0] if len(p) == 1 else torch.cat(p) for a, p in record_parts.items()}
        return (torch.cat(logits_parts) if want_logits else None), records

    def forward_with_grad(self, prompts: Prompts, plan: Plan, *, loss: Callable[[Tensor], Tensor],
                          wrt: tuple[Address, ...], shapes: Mapping[Address, tuple[int, ...]]):
        """Value and gradients of `loss(logits)` w.r.t. zero deltas added at `wrt` (torch.func)."""
        from torch.func import grad_and_value

        ids, lengths = prompts.right_padded(range(len(prompts)), self.pad_id)
        step = _step(ids, lengths, range(len(prompts)))
        zeros = {a: torch.zeros(shapes[a], dtype=self.dtype, device=self.device) for a in wrt}

        def objective(deltas: dict[Address, Tensor]) -> Tensor:
            run = Run(plan.ops, frozenset(), deltas)
            logits = _zero_padding(self._forward(ids, step, run, use_cache=False, logits_to_keep=0), step, LOGITS)
            return loss(logits)

        with self._busy, torch.enable_grad():
            grads, value = grad_and_value(objective)(zeros)
        return value.detach(), {a: _zero_padding(g, step, a) for a, g in grads.items()}

    def lens(self, prompts: Prompts, plan: Plan, *, batch_size: int, progress: bool = True) -> dict[Address, Tensor]:
        """Log-probs of the next token read off each read point (final norm + unembedding); zeros at padding."""
        _, records = self.forward(prompts, plan, batch_size=batch_size, want_logits=False, progress=progress)
        valid = torch.zeros(len(prompts), max(prompts.lengths), dtype=torch.bool)
        for i, n in enumerate(prompts.lengths):
            valid[i, :n] = True
        out = {}
        for address, resid in records.items():
            logprobs = torch.log_softmax(self.unembed(resid).float(), dim=-1)
            out[address] = torch.where(valid[..., None].to(logprobs.device), logprobs, torch.zeros((), device=logprobs.device))
        return out

    def weights(self) -> Weights:
        model = self.load()
        if self._weights is None or self._weights[0] is not model:
            # Read outside inference mode even from inside a capture (attn_result): a cached copy made there would
            # be an inference tensor, refused later by autograd wherever a user multiplies by it.
            with torch.inference_mode(False):
                self._weights = (model, read_weights(model, self.arch, self.dims))
        return self._weights[1]

    def unembed(self, resid: Tensor) -> Tensor:
        """Final norm, unembedding and (where the arch has it) final logit softcap, on a [..., d_model] tensor."""
        model = self.load()
        with torch.inference_mode():
            x = model.get_submodule(self.arch.final_norm)(resid.to(self.device))
            logits = model.get_submodule(self.arch.unembed)(x)
            cap = getattr(model.config, "final_logit_softcapping", None)
            if cap:
                logits = torch.tanh(logits / cap) * cap
            scaling = getattr(model.config, "logits_scaling", None)  # Granite divides its logits after the head
            if scaling:
                logits = logits / scaling
        return logits

    # ----------------------------------------------------------------------------------------- generate
    def generate(self, prompts: Prompts, plan: Plan, *, max_new_tokens: int, temperature: float,
                 top_k: int | None, top_p: float | None, seed: int | None, stop_at_eos: bool,
                 batch_size: int, progress: bool = True):
        from interp_engine.backends.eager.decode import decode

        with self._busy:
            return decode(self, prompts, plan, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, stop_at_eos=stop_at_eos, batch_size=batch_size,
                          progress=progress)


def _step(ids: Tensor, lengths: Tensor, rows: range) -> Step:
    cols = torch.arange(ids.shape[1])[None, :].expand(ids.shape[0], -1)
    abs_pos = torch.where(cols < lengths[:, None], cols, torch.full_like(cols, -1))
    return Step.of_rows(abs_pos, last=lengths - 1, lengths=lengths,
                prompt_index=torch.tensor(list(rows), dtype=torch.long))


def _zero_padding(t: Tensor, step: Step, address: Address) -> Tensor:
    valid = step.valid.to(t.device)
    if bool(valid.all()):
        return t
    if address.info.pos_axis == 2:
        keep = valid[:, None, :, None] & valid[:, None, None, :]
    else:
        keep = valid.reshape(*valid.shape, *([1] * (t.ndim - 2)))
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def _pad(t: Tensor, width: int, address: Address) -> Tensor:
    """Right-pad the position axis (both for patterns) to `width` with zeros."""
    if address.info.pos_axis == 2:
        extra = width - t.shape[2]
        return torch.nn.functional.pad(t, (0, extra, 0, extra)) if extra else t
    extra = width - t.shape[1]
    if not extra:
        return t
    return torch.nn.functional.pad(t, (*([0, 0] * (t.ndim - 2)), 0, extra))
