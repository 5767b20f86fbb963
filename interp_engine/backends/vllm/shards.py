"""Tensor-parallel gather and split of sharded points, written once for both vLLM backends.

A point's rows arrive on each rank as this rank's shard, `[rows, local width]` (or already split by head).
`present` turns them into the point's gathered form (`[rows, heads, d_head]` for q/k/v/z, `[rows, d_mlp]` for
mlp_act, unchanged for the replicated residual-stream points); `split` is its inverse, this rank's share of a
gathered tensor, as `[rows, ...]` (callers reshape it to the shape the model passes on). The `vllm` backend
gathers in its hooks before editing (edits see full heads); `vllm-static` taps local shards in the compiled
graph and gathers after the step. Every rank calls these in the same order (the decision to gather depends
only on the broadcast schedule), so the collectives pair up.
"""

import copy

from torch import Tensor

from interp_engine.arch.layers import config_value
from interp_engine.backends.vllm import compat, compat_modules

# How each point is sharded under tensor parallelism (points not listed are replicated).
HEADS, KV_HEADS, NEURONS, LIN_HEADS, LIN_GATES = "heads", "kv_heads", "neurons", "lin_v_heads", "lin_v_gates"
SHARDING = {"q": HEADS, "z": HEADS, "k": KV_HEADS, "v": KV_HEADS, "mlp_act": NEURONS, "mlp_pre": NEURONS,
            "mlp_pre_linear": NEURONS, "lin_out": LIN_HEADS, "lin_z": LIN_HEADS, "lin_beta": LIN_GATES,
            "lin_g": LIN_GATES}
_FLAT = (NEURONS, LIN_GATES)  # one number per neuron or head: [rows, local], gathered along the last axis


class Shards:
    def __init__(self, config, attention=None, mlp_local: int | None = None, n_experts: int = 0, d_latent: int = 0,
                 latent=None):
        """`attention`: one layer's Attention module (local head counts); `mlp_local`: mlp_act features on this
        rank. Either may be omitted where the caller never shards that kind of point. `n_experts`: the width of
        router_logits (replicated: every rank's gate computes every expert's logit); `d_latent`: kv_latent's
        (replicated: kv_a_proj_with_mqa and its norm are whole on every rank). `latent`: under latent attention
        (DeepSeek), the MLA attention module instead of `attention`: k and v, expanded from the latent per head,
        split over the ranks as q's heads do, and v and z are narrower than q and k."""
        self.widths = {"router_logits": n_experts, "kv_latent": d_latent}
        self.size, self.rank = compat.tp_size(), compat.tp_rank()
        self.kv_total = config_value(config, "num_key_value_heads") or config.num_attention_heads
        heads, kv_heads, self.d_head = compat_modules.attention_heads(attention) if attention is not None else (0, 0, 0)
        self.d_head_v = self.d_head
        if latent is not None:
            heads, self.d_head, self.d_head_v = compat_modules.latent_heads(latent)
            kv_heads, self.kv_total = heads, config.num_attention_heads
        # A Gated DeltaNet's value heads split evenly over the ranks (vLLM's QwenGatedDeltaNetAttention).
        lin = (getattr(config, "linear_num_value_heads", 0) or 0) // self.size
        self.local = {HEADS: heads, KV_HEADS: kv_heads, NEURONS: mlp_local or 0, LIN_HEADS: lin, LIN_GATES: lin}
        self.d_lin = getattr(config, "linear_value_head_dim", 0) or 0
        self.replicas = max(1, self.size // self.kv_total)  # ranks holding each kv head when size > kv heads
        self.layers: tuple[Shards, ...] = ()  # per layer, where layers differ in widths (`at`)

    def at(self, attention, kv_total: int, mlp_local: int) -> "Shards":
        """These shards at a layer of other widths (Gemma 4's global layers' heads, its double-wide MLPs): that
        layer's Attention module, its total KV heads and its mlp_act features on this rank."""
        own = copy.copy(self)
        own.kv_total, own.replicas = kv_total, max(1, self.size // kv_total)
        heads, kv_heads, own.d_head = compat_modules.attention_heads(attention)
        own.d_head_v = own.d_head
        own.local = {**self.local, HEADS: heads, KV_HEADS: kv_heads, NEURONS: mlp_local}
        return own

    def layer(self, layer: int | None) -> "Shards":
        """The shards of points at `layer` (a model-wide point's: None)."""
        return self.layers[layer] if self.layers and layer is not None else self

    # ------------------------------------------------------------------------------------------- shapes
    def _width(self, point: str) -> int:
        return self.d_head_v if point in ("v", "z") else self.d_head

    def local_width(self, point: str, d_model: int) -> int:
        """Features of one row of `point` on this rank, flat."""
        kind = SHARDING.get(point)
        if kind in (HEADS, KV_HEADS):
            return self.local[kind] * self._width(point)
        if kind == LIN_HEADS:
            return self.local[kind] * self.d_lin
        return self.local[kind] if kind in _FLAT else self.widths.get(point, d_model)

    def shape(self, point: str, d_model: int) -> tuple[int, ...]:
        """One row of `point`, gathered."""
        kind = SHARDING.get(point)
        if kind == HEADS:
            return (self.local[HEADS] * self.size, self._width(point))
        if kind == KV_HEADS:
            return (self.kv_total, self._width(point))
        if kind == LIN_HEADS:
            return (self.local[kind] * self.size, self.d_lin)
        return (self.local[kind] * self.size,) if kind in _FLAT else (self.widths.get(point, d_model),)

    def sharded(self, point: str) -> bool:
        """Whether this rank holds only a slice of `point`'s rows."""
        return self.size > 1 and point in SHARDING

    # ------------------------------------------------------------------------------------------- collectives
    def gather(self, x: Tensor, dim: int) -> Tensor:
        return x if self.size == 1 else compat.all_gather(x, dim)

    def present(self, point: str, x: Tensor) -> Tensor:
        """This rank's rows of `point` ([rows, ...] in the model's layout) -> the gathered rows."""
        kind = SHARDING.get(point)
        if kind in (HEADS, LIN_HEADS):
            return self.gather(x.reshape(len(x), self.local[kind], -1), 1)
        if kind == KV_HEADS:
            # With more ranks than kv heads each head is on `replicas` ranks: keep one copy of each.
            full = self.gather(x.reshape(len(x), self.local[KV_HEADS], -1), 1)
            return full if self.replicas == 1 else full[:, ::self.replicas]
        if kind in _FLAT:
            return self.gather(x, -1)
        return x

    def split(self, point: str, full: Tensor) -> Tensor:
        """The inverse of `present`: this rank's share of gathered rows (heads kept as an axis)."""
        kind = SHARDING.get(point)
        if self.size == 1 or kind is None:
            return full
        local = self.local[kind]
        if kind in (HEADS, LIN_HEADS):
            return full.narrow(1, self.rank * local, local)
        if kind == KV_HEADS:
            return full.narrow(1, (self.rank // self.replicas) * local, local)
        return full.narrow(-1, self.rank * local, local)
