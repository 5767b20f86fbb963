"""`model.weights` on the vLLM backends: the workers' parameters, gathered over tensor-parallel ranks, fetched once
per engine, and read into TransformerLens's shapes by the eager backend's own reader.

Worker side (`WeightsExtension.ie_weights`, an RPC of every worker): each module's parameters are gathered the
way vLLM split them (`compat_modules.sharding`: column-parallel by output rows, q/k/v and gate/up each on its own;
row-parallel by input columns; the vocabulary by rows, its padding cut), so rank 0 holds the checkpoint's
tensors under vLLM's names, with the merged `qkv_proj` as [q; k; v] and `gate_up_proj` as [gate; up] (Phi-3's own
layout). Quantized layers are refused before any gather. Rank 0 writes a safetensors file the driver names (bytes
from another host): plain tensors, never pickle.

Driver side (`fetch`): the merged projections are cut back into HF's names where the HF model has separate ones,
loaded into the HF model built on the meta device (no memory), and `backends/eager/weights.read_weights` makes
the `Weights`: the same names, shapes and norms as on eager, by construction.
"""

import contextlib
import os
import uuid

import torch
from torch import Tensor

from interp_engine.backends.vllm import compat, compat_modules, wire
from interp_engine.errors import BackendError, fix
from interp_engine.weights import Weights, check_served

REFUSED = "interp_engine_refused"  # an `ie_weights` answer: why the weights cannot be handed out


class WeightsExtension:
    """Mixed into `worker.InterpExtension`: the RPC behind `model.weights`."""

    def ie_weights(self, path: str = "", host: str = "") -> bytes | str | dict:
        model = compat.model(self.model_runner)
        modules = [(name, m) for name, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        # Every rank sees the same layers: all refuse before the first gather, or none does.
        methods = sorted({method for _, m in modules if (method := compat_modules.quantized(m)) is not None})
        if methods:
            return {REFUSED: fix(f"this engine's weights are quantized ({', '.join(methods)}); TransformerLens-shaped "
                                 "weights are read from plain floating-point parameters and are not dequantized.",
                                 "load the checkpoint without quantization= (any backend) to read its weights.")}
        flat, seen = {}, set()
        for prefix, m in modules:
            for name, p in m.named_parameters(recurse=False):
                if p.numel() and p.data_ptr() in seen:  # a tied head: the driver ties HF's to the embedding again
                    continue
                seen.add(p.data_ptr())
                flat[f"{prefix}.{name}" if prefix else name] = _gathered(p.data, *compat_modules.sharding(m))
        if compat.tp_rank() != 0:
            return b""
        from safetensors.torch import save, save_file

        if path and wire.same_host(host):
            save_file(flat, path)
            return path
        return save(flat)


def _gathered(x: Tensor, kind: str, blocks: tuple[int, ...], replicas: int) -> Tensor:
    """One parameter as the unsharded model holds it, on the host (every rank takes part in the gathers)."""
    if kind == "rows":
        parts = [compat.all_gather(part, 0) for part in x.split(list(blocks), 0)]
        if replicas > 1:  # more ranks than kv heads: each k/v head is on `replicas` consecutive ranks, kept once
            parts[1:] = [p.view(-1, n, *p.shape[1:])[::replicas].flatten(0, 1) for p, n in zip(parts[1:], blocks[1:])]
        x = torch.cat(parts)
    elif kind == "cols" and x.dim() == 2:
        x = compat.all_gather(x, 1)
    elif kind == "vocab":
        x = compat.all_gather(x, 0)[:blocks[0]]
    return x.detach().cpu().contiguous()


def fetch(runtime) -> Weights:
    """The handle's weights: fetched at the first read after each engine start, then the same object."""
    check_served(runtime.arch)  # before the engine starts
    if not runtime.capabilities.points:
        raise BackendError(fix(f"backend={runtime.capabilities.backend!r} runs a plain vLLM engine, without the worker "
                               "extension that hands weights out.", 'load with backend="vllm" (or "eager").'))
    cached = getattr(runtime, "_tl_weights", None)
    if cached is not None and cached[0] is runtime.llm and runtime.llm is not None:
        return cached[1]
    path = wire.result_path(f"weights-{uuid.uuid4().hex}")
    try:
        answers = runtime._rpc(wire.WEIGHTS, path, wire.host())
        if isinstance(answers[0], dict):
            raise BackendError(answers[0][REFUSED])
        flat = wire.decode(answers[0])
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    weights = _read(flat, runtime)
    runtime._tl_weights = (runtime.llm, weights)
    return weights


def _read(flat: dict[str, Tensor], runtime) -> Weights:
    from transformers import AutoConfig, AutoModelForCausalLM

    from interp_engine.backends.eager.weights import read_weights

    trust = runtime.engine_kwargs.get("trust_remote_code") is True
    config = AutoConfig.from_pretrained(runtime.source, trust_remote_code=trust)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust)
    from transformers.pytorch_utils import Conv1D

    names = set(model.state_dict())
    # vLLM's Transformers backend names the base model `model` and the head `lm_head` (GPT-NeoX's: gpt_neox, embed_out)
    head = next(name for name, m in model.named_modules() if m is model.get_output_embeddings())
    renamed = {"model": model.base_model_prefix, "lm_head": head}
    state = {}
    for key, x in flat.items():
        first, _, rest = key.partition(".")
        hf = f"{renamed.get(first, first)}.{rest}"
        state[hf if key not in names and hf in names else key] = x
    state = _hf_names(state, names, runtime.dims)
    for key in [k for k in state if k.endswith(".weight") and k in names]:
        if isinstance(model.get_submodule(key.removesuffix(".weight")), Conv1D):  # GPT-2's: [in, out], vLLM's transposed
            state[key] = state[key].t().contiguous()
    model.load_state_dict(state, strict=False, assign=True)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight.is_meta:  # tied: vLLM keeps one matrix, HF's head shares the embedding's
        head.weight = embed.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise BackendError(fix(f"internal: the vLLM workers hold no tensor for {missing[:5]} of {runtime.name!r}.",
                               'report it as an interp_engine bug; backend="eager" reads these weights.'))
    return read_weights(model, runtime.arch, runtime.dims)


def _hf_names(flat: dict[str, Tensor], names: set[str], dims) -> dict[str, Tensor]:
    """vLLM's names -> HF's: a merged projection the HF model keeps separate is cut back into its parts."""
    qkv = (dims.n_heads * dims.d_head, dims.n_kv_heads * dims.d_head, dims.n_kv_heads * dims.d_head)
    split = {"qkv_proj": (("q_proj", "k_proj", "v_proj"), qkv), "gate_up_proj": (("gate_proj", "up_proj"), None)}
    out = {}
    for key, x in flat.items():
        parent, _, leaf = key.rpartition(".")
        parent, _, module = parent.rpartition(".")
        if key in names or module not in split:
            out[key] = x
            continue
        parts, sizes = split[module]
        for part, piece in zip(parts, x.split(list(sizes)) if sizes else x.chunk(2)):
            out[f"{parent}.{part}.{leaf}"] = piece
    return out
