"""The GPU sizer: what a `load_model(...)` call needs per GPU, priced from config.json alone, and whether it fits.

Nothing is downloaded and no weights are read. Per GPU it adds:

- weights: the parameter count from the per-family `LAYOUTS` table (equal to HF's own count) at the model dtype,
  except the weight matrices of the decoder blocks' linear layers (attention and MLP projections, GPT-2's Conv1D
  included), which `quantization` narrows (`SCHEMES`):
    fp8       1 byte/param + one fp32 scale per matrix (vLLM's online per-tensor fp8)
    bnb-4bit  0.5 byte/param + an 8-bit absmax per 64 params + an fp32 one per 16384 (NF4, double quant)
    bnb-8bit  1 byte/param + one fp32 scale per output row
  Embeddings, learned positions, lm_head, biases and norms stay at the model dtype under every scheme. A checkpoint
  that ships quantized (config.json's quantization_config) is priced as shipped where the scheme is one of these.
- KV cache: `kv_bytes_per_token` = 2 * n_layers * n_kv_heads * d_head * bytes(kv dtype), x max_model_len x
  concurrency; kv_cache_dtype "fp8" is 1 byte, "auto" (or None) the model dtype. Sliding-window layers (Gemma-2)
  are priced at full length, an upper bound. MLA caches one latent per layer instead of K and V, held whole by
  every rank; linear-attention layers hold a fixed state per sequence instead (`sizing_shapes`).
- captures (vllm-static only): the read buffers its taps allocate (`Taps.buffers`: the declared points, the final
  norm's output, and q and k for an attention pattern), `tokens_per_step(gpu)` rows x this rank's width x the
  model dtype; and for each declared write (`static_writes`) two buffers of the same rows and width, the `mul`
  and `add` its taps apply (`backends/vllm/static.py`); for the SAEs in static_writes, their taps' buffers and
  one step's largest dense encode (`sae_taps.tap_bytes`).
- overhead: a fixed `OVERHEAD_BYTES` per GPU.

Over num_gpus (tensor parallel on vLLM, device_map="auto" on eager) weights and KV divide by num_gpus, except the
norms, routers and MLA's down-projections, which every rank holds whole (routed experts divide: vLLM splits each
expert's neurons), and vLLM keeps at least one KV head per rank (it replicates KV heads when
num_gpus > n_kv_heads). Capture buffers hold this rank's heads and neurons (gathered after each step). It fits when the per-GPU
sum is at most gpu_memory_utilization x the card's memory (vLLM's budget; on eager, headroom for the allocator).
dtype="auto" is what load_model resolves on a GPU: the checkpoint's dtype (float32 when config.json states none), on
every backend, since load_model hands vLLM that dtype explicitly.
"""

import difflib
import inspect
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from interp_engine.addresses import Address
from interp_engine.arch import Dims
from interp_engine.errors import BackendError, InputTypeError, LoadError, SpecError, fix
from interp_engine.loading import load_model
from interp_engine.quantization import (KV_CACHE_DTYPES, check_kv_cache_dtype, check_runs, check_scheme,
                                        check_shipped, shipped_quantization)
from interp_engine.backends import capabilities
from interp_engine.selection import Hardware, check_backend
from interp_engine.sizing_shapes import (ParamCount, count_params, kv_bytes_per_token, model_dtype, read_sizes,
                                         shipped_scheme, state_bytes_per_sequence, to_config)
from interp_engine.sizing_tables import (GPUS_MIB, LAYOUTS, OVERHEAD_BYTES, SCHEMES, WRAPPERS, GiB, Layout, Linear,
                                         Norm, Scheme, tokens_per_step)
from interp_engine.sae import SAE
from interp_engine.sae_taps import declared_saes, tap_bytes
from interp_engine.spec import Splice
from interp_engine.taps import Taps, declare

__all__ = ["GPUS_MIB", "KV_CACHE_DTYPES", "LAYOUTS", "OVERHEAD_BYTES", "SCHEMES", "GiB", "Layout", "Linear", "Norm",
           "Scheme", "ParamCount", "SizeEstimate", "count_params", "estimate", "estimate_from_config",
           "kv_bytes_per_token", "read_config", "snippet", "state_bytes_per_sequence", "to_config",
           "tokens_per_step"]


def read_config(repo_or_path: Any) -> tuple[str, dict]:
    """(what load_model is given, config.json parsed) for a folder, a config.json path, or a repo id in the HF cache."""
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(repo_or_path, str | os.PathLike) or not str(repo_or_path):
        raise InputTypeError(fix(f"expected a repo id or a path, got {repo_or_path!r}.",
                                 'e.g. estimate("Qwen/Qwen3-8B") or estimate("./my-checkpoint").'))
    source, path = str(repo_or_path), Path(repo_or_path).expanduser()
    if path.is_dir() and not (path / "config.json").is_file():
        raise LoadError(fix(f"{source} has no config.json, so it is not a HF checkpoint folder.",
                            "point at the folder save_pretrained() wrote, or at a config.json file."))
    if path.is_dir():
        file = path / "config.json"
    elif path.is_file():
        source, file = str(path.parent), path
    else:
        try:
            found = try_to_load_from_cache(source, "config.json")
        except ValueError:  # not a valid repo id either
            found = None
        if not isinstance(found, str):
            raise LoadError(fix(
                f"{source!r} is neither a local folder, a config.json path, nor a repo in the local HF cache; "
                "the sizer never downloads, so no download was attempted.",
                "pass a local folder that holds config.json (or that file's path), or fetch it where a network "
                f"exists: huggingface-cli download {source} config.json"))
        file = Path(found)
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise LoadError(fix(f"{file} cannot be read as JSON ({e.__class__.__name__}: {e}).",
                            "make config.json readable and valid JSON; the sizer reads no other file.")) from None
    return source, config


@dataclass(frozen=True, slots=True)
class SizeEstimate:
    """What one load_model(...) call needs per GPU; `report()` is the text the CLI prints. Sizes are in bytes."""

    repo_id: str
    model_type: str
    backend: str
    dtype: str
    quantization: str | None
    kv_cache_dtype: str | None
    num_gpus: int
    max_model_len: int
    concurrency: int
    static_points: tuple[str, ...]
    gpu: str
    gpu_memory_utilization: float
    params: int
    weight_bytes: int
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int
    kv_bytes: int  # at max_model_len x concurrency, all GPUs together
    kv_bytes_per_gpu: int
    capture_bytes: int  # per GPU
    overhead_bytes: int  # per GPU
    per_gpu_bytes: int
    gpu_capacity_bytes: int
    budget_bytes: int  # gpu_memory_utilization x gpu_capacity_bytes
    fits: bool
    max_len_that_fits: int  # the longest max_model_len whose KV cache fits beside the rest, at this concurrency
    snippet: str
    notes: tuple[str, ...] = ()
    static_writes: tuple[str, ...] = ()
    active_params: int = 0  # what one token runs: all but the routed experts it is not sent to
    expert_bytes_per_gpu: int = 0  # this rank's share of the routed experts (vLLM splits each expert's neurons)
    kv_latent: bool = False  # MLA: one latent per token and layer, held whole by every rank
    state_bytes_per_sequence: int = 0  # linear-attention layers' fixed state of one sequence, all ranks together
    state_bytes_per_gpu: int = 0  # x concurrency, this rank's heads
    sae_bytes: int = 0  # per GPU, part of capture_bytes: the SAEs declared in static_writes (sae_taps.tap_bytes)

    def report(self) -> str:
        def gib(n: int) -> str:
            return f"{n / GiB:.2f} GiB"

        spare = self.budget_bytes - self.per_gpu_bytes
        room = (f"the longest max_model_len that fits is {self.max_len_that_fits:,}" if self.max_len_that_fits
                else "even with no KV cache it does not fit: quantize, add GPUs, or pick a larger card")
        taps = ([f"{len(self.static_points)} points"] * bool(self.static_points)
                + [f"{len(self.static_writes)} writes x 2 buffers (mul, add)"] * bool(self.static_writes))
        points = f"{' + '.join(taps)} x {tokens_per_step(self.gpu):,} tokens/step" if taps else "no static points"
        points += f"; SAE taps {gib(self.sae_bytes)}" if self.sae_bytes else ""
        return "\n".join([
            f"{self.repo_id}: {self.model_type}, {_human(self.params)} parameters"
            + (f" ({_human(self.active_params)} active per token)" if self.active_params != self.params else "")
            + f", on {self.num_gpus} x {self.gpu}",
            f"  backend={self.backend} dtype={self.dtype} quantization={self.quantization} "
            f"kv_cache_dtype={self.kv_cache_dtype or 'auto'}",
            f"  weights   {gib(self.weight_bytes)} in all, {gib(self.weight_bytes_per_gpu)} per GPU"
            + (f" (routed experts {gib(self.expert_bytes_per_gpu)} of it)" if self.expert_bytes_per_gpu else ""),
            f"  KV cache  {gib(self.kv_bytes)} in all, {gib(self.kv_bytes_per_gpu)} per GPU "
            f"({self.kv_bytes_per_token:,} bytes/token x {self.max_model_len:,} tokens x {self.concurrency} at once"
            + ("; MLA latent, every rank holds it whole)" if self.kv_latent else ")"),
            *([f"  state     {gib(self.state_bytes_per_gpu)} per GPU (linear-attention layers, "
               f"{self.state_bytes_per_sequence:,} bytes/sequence x {self.concurrency}, whatever the length)"]
              * bool(self.state_bytes_per_sequence)),
            f"  captures  {gib(self.capture_bytes)} per GPU ({points})",
            f"  overhead  {gib(self.overhead_bytes)} per GPU (CUDA context, workspaces, one step's activations)",
            f"  per GPU   {gib(self.per_gpu_bytes)} of {gib(self.budget_bytes)} usable "
            f"({self.gpu_memory_utilization} x {gib(self.gpu_capacity_bytes)})",
            f"  fits: yes, {gib(spare)} to spare" if self.fits else f"  fits: NO, {gib(-spare)} over; {room}",
            *(f"  note: {note}" for note in self.notes),
            "", "load_model call priced above:", "", self.snippet,
        ])


def estimate(repo_or_path: Any, *, backend: str = "vllm", quantization: str | None = None,
             kv_cache_dtype: str | None = None, num_gpus: int = 1, max_model_len: int | None = None,
             concurrency: int = 1, static_points: Any = None, static_writes: Any = None, gpu: str = "H100-80GB",
             gpu_memory_utilization: float = 0.9, dtype: Any = "auto") -> SizeEstimate:
    """Price load_model(repo_or_path, ...) on num_gpus x gpu from config.json alone (see the module docstring)."""
    source, config = read_config(repo_or_path)
    return estimate_from_config(config, repo_id=source, backend=backend, quantization=quantization,
                                kv_cache_dtype=kv_cache_dtype, num_gpus=num_gpus, max_model_len=max_model_len,
                                concurrency=concurrency, static_points=static_points, static_writes=static_writes,
                                gpu=gpu, gpu_memory_utilization=gpu_memory_utilization, dtype=dtype)


def estimate_from_config(config: Any, *, repo_id: str | None = None, backend: str = "vllm",
                         quantization: str | None = None, kv_cache_dtype: str | None = None, num_gpus: int = 1,
                         max_model_len: int | None = None, concurrency: int = 1, static_points: Any = None,
                         static_writes: Any = None, gpu: str = "H100-80GB", gpu_memory_utilization: float = 0.9,
                         dtype: Any = "auto") -> SizeEstimate:
    """`estimate` for a config.json dict or a transformers config; `repo_id` is what the snippet loads."""
    wrapper = (config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None))
    config = to_config(config)
    repo_id = str(repo_id or getattr(config, "_name_or_path", "") or "REPO_OR_PATH")
    d = read_sizes(config)
    _check_knobs(backend, quantization, kv_cache_dtype, num_gpus, concurrency, gpu_memory_utilization, d)
    check_shipped(config, quantization, repo_id)
    gpu, dtype_ = _gpu_name(gpu), model_dtype(config, dtype)
    name = str(dtype_).removeprefix("torch.")
    check_runs(quantization, backend, dtype_, Hardware(cuda=True))
    shipped, packed = shipped_quantization(config), shipped_scheme(config)
    scheme = quantization or (shipped if shipped in SCHEMES else packed)
    length = d.max_len if max_model_len is None else _count("max_model_len", max_model_len)
    if length > d.max_len:
        raise SpecError(fix(f"max_model_len={length} is above this model's limit of {d.max_len} tokens "
                            "(max_position_embeddings in config.json).", f"pass max_model_len={d.max_len} or less."))
    points, writes, sae_taps = _taps(static_points, static_writes, backend, d, num_gpus)
    vllm = capabilities(backend).vllm_engine
    count, size = count_params(config), dtype_.itemsize
    weights, replicated = count.bytes(size, scheme), (count.norms + count.replicated_linear) * size
    weights_per_gpu = replicated + -(-(weights - replicated) // num_gpus)
    experts = ParamCount(count.routed, 0, 0, 0, 0, routed=count.routed).bytes(size, scheme)
    kv_token = kv_bytes_per_token(config, kv_cache_dtype, dtype=dtype)
    latent = LAYOUTS[config.model_type].cache == "latent"
    kv_token_per_gpu = (-(-kv_token // num_gpus) if not vllm else kv_token if latent
                        else kv_token * max(d.n_kv_heads // num_gpus, 1) // d.n_kv_heads)
    state = state_bytes_per_sequence(config, dtype=dtype)
    # vllm-static's buffers, one step of rows each, at this rank's share of heads and neurons: one per read
    # buffer, two per write (mul and add).
    local = {"n_heads": d.n_heads // num_gpus, "n_kv_heads": max(d.n_kv_heads // num_gpus, 1), "d_head": d.d_head,
             "d_head_v": d.d_head_v, "d_mlp": d.d_mlp // num_gpus, "d_model": d.d_model, "d_latent": d.d_latent}
    buffers = (*(Taps(points, ()).buffers() if points or writes else ()), *writes, *writes)
    captures = size * tokens_per_step(gpu) * sum(math.prod(local[a] for a in p.info.axes if a in local)
                                                 for p in buffers)
    sae_bytes = tap_bytes(*sae_taps, d, tokens_per_step(gpu))
    captures += sae_bytes
    capacity = GPUS_MIB[gpu] * 2**20
    state_per_gpu = -(-state // num_gpus) * concurrency
    budget = int(capacity * gpu_memory_utilization)
    fixed = weights_per_gpu + captures + OVERHEAD_BYTES + state_per_gpu
    per_gpu = fixed + kv_token_per_gpu * length * concurrency
    notes = (["max_model_len and gpu_memory_utilization price the run; eager's load_model takes neither"]
             * (not vllm)
             + ["concurrency prices simultaneous sequences; it is not a load_model argument"] * (concurrency > 1)
             + ["no static_points declared, so nothing is captured"]
             * (capabilities(backend).declares_taps and not points)
             + [f"the checkpoint ships quantized ({shipped}), so it is priced as shipped and the call has no "
                "quantization="] * (shipped in SCHEMES)
             + [f"the checkpoint ships quantized ({shipped}); its weights are priced at {name}, an upper "
                "bound"] * (shipped is not None and shipped not in SCHEMES and packed is None)
             + ([f"the checkpoint ships its routed experts packed ({shipped}: {packed.per_param * 8:g}-bit, one "
                 f"bf16 scale per {packed.blocks[0][0]}), priced as shipped; the rest at {name}"]
                if packed is not None and scheme is packed else [])
             + [f"{wrapper} wraps a {config.model_type} text model: that is priced, its vision tower is not"]
             * (wrapper in WRAPPERS)
             + ["the snippet writes the k-th SAE of static_writes as saes[k]: bind them (load_sae) first"]
             * any(sae_taps))
    priced = {"dtype": None if dtype == "auto" else str(dtype).removeprefix("torch."), "quantization": quantization,
              "kv_cache_dtype": None if kv_cache_dtype == "auto" else kv_cache_dtype,
              "num_gpus": None if num_gpus == 1 else num_gpus,
              "static_points": _priced(static_points), "static_writes": _priced(static_writes),
              "gpu_memory_utilization": gpu_memory_utilization if vllm and gpu_memory_utilization != 0.9 else None,
              "max_model_len": length if vllm and length != d.max_len else None}
    return SizeEstimate(
        repo_id=repo_id, model_type=config.model_type, backend=backend,
        dtype=name, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
        num_gpus=num_gpus, max_model_len=length, concurrency=concurrency, static_points=tuple(map(str, points)),
        gpu=gpu, gpu_memory_utilization=gpu_memory_utilization, params=count.total, weight_bytes=weights,
        weight_bytes_per_gpu=weights_per_gpu, kv_bytes_per_token=kv_token, kv_bytes=kv_token * length * concurrency,
        kv_bytes_per_gpu=kv_token_per_gpu * length * concurrency, capture_bytes=captures,
        overhead_bytes=OVERHEAD_BYTES, per_gpu_bytes=per_gpu, gpu_capacity_bytes=capacity, budget_bytes=budget,
        fits=per_gpu <= budget,
        max_len_that_fits=min(max(budget - fixed, 0) // max(kv_token_per_gpu * concurrency, 1), d.max_len),
        snippet=snippet(repo_id, backend=backend, **priced), notes=tuple(notes), static_writes=tuple(map(str, writes)),
        active_params=count.active, expert_bytes_per_gpu=-(-experts // num_gpus), kv_latent=latent,
        state_bytes_per_sequence=state, state_bytes_per_gpu=state_per_gpu, sae_bytes=sae_bytes)


def snippet(repo_id: str, *, backend: str, **priced: Any) -> str:
    """The load_model call, keywords in load_model's order; those at their default (None) are left out."""
    order = [name for name in inspect.signature(load_model).parameters if priced.get(name) is not None]
    args = [_literal(repo_id), f"backend={_literal(backend)}", *(f"{k}={_literal(priced[k])}" for k in order)]
    return f"from interp_engine import load_model\n\nmodel = load_model({', '.join(args)})\n"


def _literal(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_literal, value)) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _check_knobs(backend, quantization, kv_cache_dtype, num_gpus, concurrency, utilization, d: Dims) -> None:
    if check_backend(backend) == "auto":
        raise BackendError(fix('backend="auto" picks vLLM or eager only at load time, so it cannot be priced.',
                               'name the backend you will load with: "vllm", "vllm-static", "vllm-generate", "eager".'))
    check_scheme(quantization, backend)
    check_kv_cache_dtype(kv_cache_dtype, None if kv_cache_dtype == "auto" else backend)
    _count("num_gpus", num_gpus), _count("concurrency", concurrency)
    if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
        raise SpecError(fix(f"gpu_memory_utilization={utilization!r} is not a fraction in (0, 1].",
                            "pass the share of each GPU's memory to use, e.g. 0.9 (the default)."))
    ok = [n for n in range(1, d.n_heads + 1) if d.n_heads % n == 0 and (d.n_kv_heads % n == 0 or n % d.n_kv_heads == 0)]
    if capabilities(backend).vllm_engine and num_gpus not in ok:
        raise SpecError(fix(f"num_gpus={num_gpus} cannot split {d.n_heads} attention heads and {d.n_kv_heads} KV "
                            "heads evenly, as vLLM's tensor parallelism needs.", f"use num_gpus in {ok}."))


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(fix(f"{name}={value!r}: it must be a whole number, at least 1.", f"pass {name}=1 or more."))
    return value


def _gpu_name(gpu: Any) -> str:
    by_lower = {name.lower(): name for name in GPUS_MIB}
    if str(gpu).lower() in by_lower:
        return by_lower[str(gpu).lower()]
    near = [name for name in GPUS_MIB if name.lower().startswith(str(gpu).lower())] or \
        [by_lower[difflib.get_close_matches(str(gpu).lower(), list(by_lower), n=1, cutoff=0.0)[0]]]
    raise SpecError(fix(f"gpu={gpu!r} is not a GPU the sizer knows.",
                        f"did you mean {' or '.join(map(repr, near))}? Known GPUs: {', '.join(GPUS_MIB)}."))


def _taps(points: Any, writes: Any, backend: str, d: Dims, num_gpus: int) -> tuple[tuple, tuple, tuple]:
    """(declared reads, declared writes, (clamp points, SAEs compiled whole)), refused as load_model refuses them."""
    for keyword, value in (("static_points", points), ("static_writes", writes)):
        if value is not None and not capabilities(backend).declares_taps:
            raise BackendError(fix(f"{keyword}= declares the taps of vllm-static; backend={backend!r} has none.",
                                   f'use backend="vllm-static", or drop {keyword}=.'))
    reads = declare(points, d.n_layers, keyword="static_points")
    if writes is None:
        return reads, (), ((), ())
    writes, clamps, splices = declared_saes(writes, d, num_gpus)
    # Refuses an eager-only write, as load_model does.
    return reads, Taps.of(None, writes, d.n_layers, clamps, splices).writes, (clamps, splices)


def _priced(points: Any) -> Any:
    """As the snippet writes them; the k-th distinct SAE in static_writes is `saes[k]` (its weights are no literal)."""
    if points in (None, "auto"):
        return points
    saes = list(dict.fromkeys((p if isinstance(p, SAE) else p.sae).key for p in points if isinstance(p, SAE | Splice)))
    return [_Named(f"saes[{saes.index(p.key)}]") if isinstance(p, SAE) else
            _Named(f"S.Splice(saes[{saes.index(p.sae.key)}])") if isinstance(p, Splice) else str(Address.parse(p))
            for p in points]


@dataclass(frozen=True, slots=True)
class _Named:
    """A name in the snippet, written as is (not a quoted string)."""

    name: str

    def __repr__(self) -> str:
        return self.name


def _human(n: int) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)
