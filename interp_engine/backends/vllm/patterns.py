"""Attention patterns in the workers: rebuilt from the post-rotary q and k that reach vLLM's attention kernel
(paged attention never materialises probabilities). Shared by both vLLM backends."""

import torch
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, compat_modules
from interp_engine.backends.vllm.wire import recording_failed
from interp_engine.taps import PATTERNS


def record_patterns(state, layer: int, q: Tensor, k: Tensor | None, attention, source: int | None = None,
                    sharers: tuple[int, ...] = ()) -> None:
    """attn_scores / attn_probs rows for the calls that read them, from post-rotary q and every key so far.

    q and k arrive gathered ([rows, heads, d_head]). Keys are kept per (prompt, layer) across steps, so a
    chunked prefill still sees its earlier chunks. A KV-shared layer (Gemma 4) has no k (None): its q meets the
    keys kept at its `source` layer, which runs earlier in the same forward and keeps them for its `sharers`'
    patterns too."""
    scores_at, probs_at = Address("attn_scores", layer), Address("attn_probs", layer)
    shared = {a for s in sharers for a in (Address("attn_scores", s), Address("attn_probs", s))}
    scale = compat_modules.attention_scale(attention)
    cap = compat_modules.attention_soft_cap(attention)
    window = compat_modules.attention_window(attention)
    sinks = compat_modules.attention_sinks(attention)
    if sinks is not None and sinks.shape[0] != q.shape[1]:
        # This rank's heads' sinks, q gathered over every head: gather them too, here and not per call, so that
        # every rank (each calls this at the same layers: the schedule is broadcast) runs the collective alike.
        sinks = compat.all_gather(sinks, 0)
    for active in state.active:
        call = active.call
        own = scores_at in call.reads or probs_at in call.reads
        if call.error or not state.recording or not (own or shared & call.reads):
            continue
        try:  # contained to this call (no collective in here): see WorkerCall.fail
            if k is not None:
                _keep_keys(call, active, layer, k)
            if own:
                _record(state, call, active, layer, q, layer if source is None else source, scale, cap, window,
                        sinks)
        except Exception as e:
            call.fail(recording_failed(scores_at if scores_at in call.reads else probs_at, e), in_spec=False)


def _keep_keys(call, active, layer: int, k: Tensor) -> None:
    """This step's keys of each of the call's prompts at `layer`, after those of its earlier steps."""
    k_rows = k.index_select(0, active.rows).float()
    prompts, positions = active.step.prompt_index[0], active.step.abs_pos[0]
    for prompt in prompts.unique().tolist():
        mine = prompts == prompt
        call.keys.setdefault((prompt, layer), []).append((positions[mine], k_rows[mine]))


def _record(state, call, active, layer: int, q: Tensor, keys_at: int, scale: float, cap, window,
            sinks=None) -> None:
    """One call's pattern rows at `layer`, its q against the keys kept at layer `keys_at` (its own, or a KV-shared
    layer's source). `sinks` (GPT-OSS) join each row's softmax as a column dropped after it, as on eager
    (arch/gpt_oss.py)."""
    scores_at, probs_at = Address("attn_scores", layer), Address("attn_probs", layer)
    n_heads = q.shape[1]
    q_rows = q.index_select(0, active.rows).float()
    prompts, positions, lengths = active.step.prompt_index[0], active.step.abs_pos[0], active.step.lengths[0]
    for prompt in prompts.unique().tolist():
        mine = prompts == prompt
        length = int(lengths[mine][0])
        stash = call.keys[(prompt, keys_at)]
        key_pos = torch.cat([p for p, _ in stash])
        keys = torch.cat([t for _, t in stash])
        keys = keys.repeat_interleave(n_heads // keys.shape[1], dim=1)
        q_pos = positions[mine]
        scores = torch.einsum("qhd,khd->qhk", q_rows[mine], keys) * scale
        if cap:
            scores = torch.tanh(scores / cap) * cap
        masked = key_pos[None, :] > q_pos[:, None]
        if window:
            masked |= (q_pos[:, None] - key_pos[None, :]) >= window
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            sink = sinks.float().view(1, -1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        for address, values in ((scores_at, scores), (probs_at, probs)):
            if address not in call.reads:
                continue
            row = torch.zeros((len(q_pos), n_heads, call.width), dtype=q.dtype, device=q.device)
            if address is scores_at:  # keys of later chunks, not seen yet, are future keys: masked
                row[:, :, :length] = float("-inf")
            row[:, :, key_pos] = values.to(q.dtype)
            state.record(call, address, torch.full((len(q_pos),), prompt), q_pos.cpu(), row)


def key_sharing(runner) -> dict[int, int]:
    """KV-shared layer -> the layer whose keys it attends over (Gemma 4's last layers); {} for other models."""
    from interp_engine.arch import table_for
    from interp_engine.arch.layers import kv_sources

    config = compat.hf_config(runner)
    arch = table_for(config)
    return kv_sources(config, arch) if arch is not None else {}


def sharing(sources: dict[int, int], layer: int) -> tuple[int | None, tuple[int, ...]]:
    """`record_patterns`' source and sharers at `layer`."""
    return sources.get(layer), tuple(i for i, s in sources.items() if s == layer)


def wants_patterns(needed, layer: int, sources: dict[int, int]) -> bool:
    """Whether the attention at `layer` must hand over q and k: patterns read there, or at a layer over its keys."""
    return any(Address(p, i) in needed for i in (layer, *sharing(sources, layer)[1]) for p in PATTERNS)
