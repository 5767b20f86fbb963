"""Attention functions registered with transformers' AttentionInterface.

The eager runtime points a loaded model's `_attn_implementation` at `interp_engine_<impl>` (eager,
sdpa, ...). With no site in the call's kwargs they hand straight to the model's own eager function or
to SDPA, so an un-hooked forward computes exactly what HF computes. A site (injected per call by a pre-hook on
the attention module and removed with it) gets q/k/v/z and, when asked, recomputes the pattern eagerly so
attn_scores and attn_probs can be read and written (`AttentionSite`).
"""

import functools
import sys
from collections.abc import Callable

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.eager.run import Run, at

SITE_KW = "interp_engine_site"


def name_for(impl: str) -> str:
    return f"interp_engine_{impl}"


@functools.cache
def _base(module_type: type, impl: str):
    # Called for every layer of every forward; the answer depends only on the attention class.
    if impl == "eager":
        return getattr(sys.modules[module_type.__module__], "eager_attention_forward")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[impl]


def _make(impl: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        site = kwargs.pop(SITE_KW, None)
        base = _base(type(module), impl)
        if site is None:
            return base(module, query, key, value, attention_mask, **kwargs)
        return site.attend(base, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{name_for(impl)}_attention"
    return attention


def register(impl: str) -> str:
    """Idempotent: add our wrapper of `impl` to transformers' attention and mask registries; return its name."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    name = name_for(impl)
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, _make(impl))
    if name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[impl])
    return name


def eager_pattern(query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None, *, scaling: float | None,
                  softcap: float | None, touch_scores, touch_probs, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eager attention as HF's eager functions compute it, with the scores and probs exposed to edits.

    `sinks` (GPT-OSS: one logit per head) joins each row's softmax as an extra column that is dropped after it:
    the sink is not a key position, so the scores and probs presented are the key positions' only."""
    n_rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(n_rep, dim=1) if n_rep > 1 else key
    v = value.repeat_interleave(n_rep, dim=1) if n_rep > 1 else value
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, k.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_len, k_len = scores.shape[-2:]
    low = torch.finfo(scores.dtype).min
    if mask is None:
        rows = torch.arange(q_len, device=scores.device)[:, None] + (k_len - q_len)
        masked = torch.arange(k_len, device=scores.device)[None, :] > rows
        scores = scores.masked_fill(masked, low)
    elif mask.dtype == torch.bool:
        masked = ~mask[..., :k_len]
        scores = scores.masked_fill(masked, low)
    else:
        additive = mask[..., :k_len]
        masked = additive <= low / 2
        scores = scores + additive
    # Masked entries stay finite inside the forward (an all-masked padding row must not turn into NaN and leak
    # through probs @ v); readers see them as -inf. Edits cannot unmask a key: causality is not editable.
    # Unedited, the record is this function's own scores tensor, given its -inf once the softmax has read it: a
    # copy per layer would cost as much as the softmax at 16x128 (a [batch, heads, q, k] pass, as many fresh
    # pages). An edited value may be a view of the caller's tensor (a broadcast Set), so it is copied.
    fresh, recorded = scores, []

    def present(s: Tensor) -> Tensor:
        if s is fresh:
            recorded.append(s)
            return s
        return s.masked_fill(masked, float("-inf"))

    edited = touch_scores(scores, present)
    scores = edited if edited is scores else edited.masked_fill(masked, low)
    if sinks is None:
        probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:
        sink = sinks.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1).to(scores.dtype)
        probs = torch.nn.functional.softmax(torch.cat([scores, sink], dim=-1), dim=-1,
                                            dtype=torch.float32)[..., :-1].to(query.dtype)
    for s in recorded:  # nothing below reads the scores (softmax keeps its output for backward, not its input)
        s.masked_fill_(masked, float("-inf"))
    probs = touch_probs(probs)
    out = torch.matmul(probs, v).transpose(1, 2).contiguous()
    return out, probs


def _swap(t: Tensor) -> Tensor:
    """HF attention holds q, k, v head-major; our points present them position-major (typing.Heads / KVHeads).
    The same view both ways; a plain transpose, as einops would make it, without its per-call parsing."""
    return t.transpose(1, 2)


class AttentionSite:
    """Handed to our attention function through the attention module's kwargs, for one layer."""

    def __init__(self, run: Run, layer: int, w_o: Callable[[], Tensor] | None = None):
        self.run, self.layer, self.w_o = run, layer, w_o
        # Gemma 4: the dict later KV-shared layers read this layer's keys and values from (None: none do).
        self.shares: dict | None = None
        self.q, self.k, self.v, self.z, self.scores, self.probs, self.result = (
            at(p, layer) for p in ("q", "k", "v", "z", "attn_scores", "attn_probs", "attn_result"))

    def _kv(self, address: Address, t: Tensor, q_len: int) -> Tensor:
        if not self.run.wants(address):
            return t
        current = _swap(t[:, :, -q_len:])
        edited = self.run.touch(address, current)
        if edited is current:
            return t
        edited = _swap(edited)
        if self.run.step.kv_in_place:  # t is the KV cache's own tensor: later steps must see the edit
            t[:, :, -q_len:] = edited
            return t
        return torch.cat([t[:, :, :-q_len], edited], dim=2) if t.shape[2] > q_len else edited

    def attend(self, base, module, query, key, value, attention_mask, **kwargs):
        run = self.run
        if run.wants(self.q):
            query = _swap(run.touch(self.q, _swap(query)))
        stored = key, value
        key = self._kv(self.k, key, query.shape[2])
        value = self._kv(self.v, value, query.shape[2])
        if self.shares is not None and (key is not stored[0] or value is not stored[1]):
            # HF stored the unedited pair before calling us; the sharing layers attend over the edited one (as
            # they do on vLLM, whose shared KV cache is written after our edit).
            self.shares[module.layer_type] = key, value
        scores, probs = self.scores, self.probs
        if run.wants(scores) or run.wants(probs):
            out, weights = eager_pattern(
                query, key, value, attention_mask, scaling=kwargs.get("scaling"), softcap=kwargs.get("softcap"),
                touch_scores=lambda s, present: run.touch(scores, s, present),
                touch_probs=lambda p: run.touch(probs, p), sinks=kwargs.get("s_aux"),
            )
        else:
            out, weights = base(module, query, key, value, attention_mask, **kwargs)
        z = run.touch(self.z, out)
        if run.wants(self.result):  # each head's z through its own rows of W_O [n_heads, d_head, d_model]
            w_o = self.w_o().reshape(*z.shape[2:], -1)
            run.touch(self.result, torch.einsum("bphd,hdm->bphm", z.to(w_o.dtype), w_o))
        return z, weights
