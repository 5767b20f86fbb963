"""A HF model's parameters as TransformerLens-shaped weights (interp_engine/weights.py), as views, no copies.

Each layout says where a family keeps its projections; the reshapes are the same for every family that stores
nn.Linear weights ([out, in]); GPT-2's Conv1D stores [in, out].
"""

import torch
from torch import Tensor

from interp_engine.arch import Arch, Dims
from interp_engine.errors import BackendError, fix
from interp_engine.weights import LayerWeights, Norm, Weights, check_served


def read_weights(model: torch.nn.Module, arch: Arch, dims: Dims) -> Weights:
    _check_plain(model)
    check_served(arch)
    layers = model.get_submodule(arch.layers)
    reader = _READERS.get(arch.family, _llama)
    W_U = model.get_submodule(arch.unembed).weight.detach().T
    head_bias = model.get_submodule(arch.unembed).bias
    W_pos = model.transformer.wpe.weight.detach() if arch.positional == "learned" else None
    return Weights(W_E=model.get_input_embeddings().weight.detach(), W_pos=W_pos, W_U=W_U,
                   b_U=_or_zeros(head_bias, dims.d_vocab, W_U),
                   ln_final=_norm(model.get_submodule(arch.final_norm), arch),
                   layers=tuple(reader(layers[i], arch, dims) for i in range(dims.n_layers)))


def _check_plain(model: torch.nn.Module) -> None:
    odd = sorted({type(p).__name__ if not p.is_floating_point() else str(p.dtype) for p in model.parameters()
                  if not p.is_floating_point() or type(p) not in (torch.nn.Parameter, Tensor)})
    if odd:
        raise BackendError(fix(f"this model's weights are quantized ({', '.join(odd)}); TransformerLens-shaped weights "
                               "are read from plain floating-point parameters and are not dequantized.",
                               "load the checkpoint without quantization= to read its weights."))


def _or_zeros(bias, n: int, like: Tensor) -> Tensor:
    return bias.detach() if bias is not None else torch.zeros(n, dtype=like.dtype, device=like.device)


def _norm(module: torch.nn.Module | None, arch: Arch) -> Norm | None:
    if module is None:
        return None
    w = module.weight.detach()
    eps = next(getattr(module, k) for k in ("eps", "variance_epsilon") if hasattr(module, k))
    kind = "layernorm" if arch.normalization == "layernorm" else "rmsnorm"
    scale = 1 + w if arch.normalization == "gemma_rmsnorm" else w
    return Norm(kind, scale, _or_zeros(getattr(module, "bias", None), w.shape[0], w), float(eps))


def _heads_in(w: Tensor, n: int, d_head: int) -> Tensor:
    """nn.Linear weight [n * d_head, d_model] -> [n, d_model, d_head]."""
    return w.detach().reshape(n, d_head, -1).transpose(1, 2)


def _bias(b, n: int, d_head: int, like: Tensor) -> Tensor:
    return _or_zeros(b, n * d_head, like).view(n, d_head)


def _attention(q, k, v, o, dims: Dims, like: Tensor) -> dict:
    """Separate nn.Linear q/k/v/o projections (or (weight, bias) pairs cut from a fused one)."""
    H, K, dh = dims.n_heads, dims.n_kv_heads, dims.d_head
    w = lambda m: m[0] if isinstance(m, tuple) else m.weight  # noqa: E731
    b = lambda m: m[1] if isinstance(m, tuple) else m.bias  # noqa: E731
    return dict(W_Q=_heads_in(w(q), H, dh), W_K=_heads_in(w(k), K, dh), W_V=_heads_in(w(v), K, dh),
                W_O=w(o).detach().T.reshape(H, dh, -1), b_Q=_bias(b(q), H, dh, like), b_K=_bias(b(k), K, dh, like),
                b_V=_bias(b(v), K, dh, like), b_O=_or_zeros(b(o), dims.d_model, like))


def _mlp(up, gate, down, dims: Dims, like: Tensor) -> dict:
    w = lambda m: m[0] if isinstance(m, tuple) else m.weight  # noqa: E731
    b = lambda m: m[1] if isinstance(m, tuple) else m.bias  # noqa: E731
    return dict(W_in=w(up).detach().T, W_gate=None if gate is None else w(gate).detach().T, W_out=w(down).detach().T,
                b_in=_or_zeros(b(up), dims.d_mlp, like), b_out=_or_zeros(b(down), dims.d_model, like))


def _get(layer, path: str):
    try:
        return layer.get_submodule(path)
    except AttributeError:
        return None


def _llama(layer, arch: Arch, dims: Dims) -> LayerWeights:
    """Llama, Mistral, Qwen2/3, Gemma-2/3, OLMo 2: separate projections, gated MLP."""
    a, m = layer.self_attn, layer.mlp
    like = a.q_proj.weight
    gemma = arch.normalization == "gemma_rmsnorm"
    pre_mlp = "pre_feedforward_layernorm" if gemma else "post_attention_layernorm"
    post_attn = "post_attention_layernorm" if gemma or arch.family == "olmo2" else None
    return LayerWeights(**_attention(a.q_proj, a.k_proj, a.v_proj, a.o_proj, dims, like),
                        **_mlp(m.up_proj, m.gate_proj, m.down_proj, dims, like),
                        ln1=_norm(_get(layer, "input_layernorm"), arch),
                        ln2=None if arch.family == "olmo2" else _norm(_get(layer, pre_mlp), arch),
                        ln1_post=_norm(_get(layer, post_attn), arch) if post_attn else None,
                        ln2_post=_norm(_get(layer, "post_feedforward_layernorm"), arch))


def _phi3(layer, arch: Arch, dims: Dims) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    like = a.o_proj.weight
    q, k, v = a.qkv_proj.weight.split([dims.n_heads * dims.d_head, *[dims.n_kv_heads * dims.d_head] * 2])
    gate, up = m.gate_up_proj.weight.chunk(2)
    return LayerWeights(**_attention((q, None), (k, None), (v, None), a.o_proj, dims, like),
                        **_mlp((up, None), (gate, None), m.down_proj, dims, like),
                        ln1=_norm(layer.input_layernorm, arch), ln2=_norm(layer.post_attention_layernorm, arch))


def _gpt2(layer, arch: Arch, dims: Dims) -> LayerWeights:
    """Conv1D stores [in, out]: transposed here into nn.Linear's [out, in] before the shared reshapes."""
    a, m = layer.attn, layer.mlp
    like = a.c_attn.weight
    ws, bs = a.c_attn.weight.T.chunk(3), a.c_attn.bias.chunk(3)
    return LayerWeights(**_attention(*zip(ws, bs), (a.c_proj.weight.T, a.c_proj.bias), dims, like),
                        **_mlp((m.c_fc.weight.T, m.c_fc.bias), None, (m.c_proj.weight.T, m.c_proj.bias), dims, like),
                        ln1=_norm(layer.ln_1, arch), ln2=_norm(layer.ln_2, arch))


def _gpt_neox(layer, arch: Arch, dims: Dims) -> LayerWeights:
    """query_key_value is per head [q; k; v] rows, not [all q; all k; all v]."""
    a, m = layer.attention, layer.mlp
    like = a.dense.weight
    H, dh = dims.n_heads, dims.d_head
    w = a.query_key_value.weight.view(H, 3, dh, -1)
    b = a.query_key_value.bias.view(H, 3, dh)
    q, k, v = ((w[:, i].reshape(H * dh, -1), b[:, i].reshape(-1)) for i in range(3))
    return LayerWeights(**_attention(q, k, v, a.dense, dims, like),
                        **_mlp(m.dense_h_to_4h, None, m.dense_4h_to_h, dims, like),
                        ln1=_norm(layer.input_layernorm, arch), ln2=_norm(layer.post_attention_layernorm, arch))


def _phi(layer, arch: Arch, dims: Dims) -> LayerWeights:
    a, m = layer.self_attn, layer.mlp
    return LayerWeights(**_attention(a.q_proj, a.k_proj, a.v_proj, a.dense, dims, a.dense.weight),
                        **_mlp(m.fc1, None, m.fc2, dims, a.dense.weight),
                        ln1=_norm(layer.input_layernorm, arch), ln2=None)


_READERS = {"phi3": _phi3, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "phi": _phi}
