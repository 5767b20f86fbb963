"""SAEs from disk: SAELens's folders (`cfg.json` + `sae_weights.safetensors`) and Gemma Scope's `params.npz`
(numpy without pickle), read into `SAE` data with every problem named before any weight is used."""

import json
from pathlib import Path

import torch

from interp_engine.addresses import Address
from interp_engine.errors import InterpEngineError, SpecError, fix
from interp_engine.sae import SAE, TENSORS
from interp_engine.tensor_data import SPEC_DTYPES


def load_sae(path: str | Path, *, reads: str | Address | None = None, writes: str | Address | None = None,
             dtype: torch.dtype | None = None) -> SAE:
    """An SAE from a SAELens folder (`cfg.json` + `sae_weights.safetensors`) or a Gemma Scope `params.npz`
    (a file, or the folder holding it). `reads` names the point where the file does not (Gemma Scope's never
    does; SAELens's `hook_name` is a TransformerLens name, read with `Address.parse`)."""
    p = Path(path)
    if p.is_dir() and (p / "cfg.json").is_file():
        return _from_saelens(p, reads, writes, dtype)
    npz = p / "params.npz" if p.is_dir() else p
    if npz.suffix == ".npz" and npz.is_file():
        return _from_npz(npz, reads, writes, dtype)
    raise SpecError(fix(f"{p} holds neither a SAELens SAE (cfg.json + sae_weights.safetensors) nor a Gemma Scope "
                        "params.npz.", "pass the folder SAELens's save_model wrote, or the params.npz file."))


def _point(name: str | None, given, what: str, path: Path) -> Address | None:
    if given is not None:
        return Address.parse(given)
    if name is None:
        return None
    try:
        return Address.parse(name)
    except InterpEngineError as e:
        raise SpecError(fix(f"{path}: {what} {name!r} is not a point here ({e}).",
                            f"pass {'reads' if what == 'hook_name' else 'writes'}= to load_sae.")) from None


def _read(file: Path, read):
    """`read(file)`, or the library's error: a truncated, corrupt or absurdly nested file is the caller's to fix."""
    try:
        return read(file)
    except Exception as e:  # noqa: BLE001 - each reader (json, safetensors, numpy) raises its own kinds
        raise SpecError(fix(f"{file} could not be read as an SAE file: {type(e).__name__}: {str(e)[:200]}",
                            "pass the files as SAELens or Gemma Scope saved them (a copy cut short or edited by "
                            "hand is refused).")) from None


def _from_saelens(p: Path, reads, writes, dtype) -> SAE:
    from safetensors.torch import load_file  # a flat tensor format: no code in it

    cfg = _read(p / "cfg.json", lambda f: json.loads(f.read_text()))
    if not isinstance(cfg, dict):
        raise SpecError(fix(f"{p}/cfg.json holds a {type(cfg).__name__}, not SAELens's settings object.",
                            "pass the folder SAELens's save_model wrote."))
    meta = cfg.get("metadata") or cfg.get("meta") or {}
    hook = cfg.get("hook_name") or meta.get("hook_name")
    address = _point(hook, reads, "hook_name", p)
    if address is None:
        raise SpecError(fix(f"{p}/cfg.json names no hook_name.", 'pass reads= to load_sae, e.g. reads="resid_post.3".'))
    arch = cfg.get("architecture", "standard")
    act = cfg.get("activation_fn_str") or cfg.get("activation_fn") or "relu"
    activation = {"standard": act, "jumprelu": "jumprelu", "topk": "topk", "transcoder": act,
                  "jumprelu_transcoder": "jumprelu"}.get(arch, arch)
    k = cfg.get("k") or (cfg.get("activation_fn_kwargs") or {}).get("k")
    weights = _read(p / "sae_weights.safetensors", lambda f: load_file(str(f)))
    if "log_threshold" in weights and "threshold" not in weights:  # a training checkpoint's JumpReLU
        weights["threshold"] = weights.pop("log_threshold").exp()
    return _built(weights, address, _point(cfg.get("hook_name_out"), writes, "hook_name_out", p), activation, k,
                  cfg.get("normalize_activations", "none"), bool(cfg.get("apply_b_dec_to_input", False)), dtype, p)


def _from_npz(p: Path, reads, writes, dtype) -> SAE:
    import numpy as np

    if reads is None:
        raise SpecError(fix(f"{p} (Gemma Scope) does not say which point it reads.",
                            'pass reads= to load_sae, e.g. load_sae(path, reads="resid_post.12").'))
    def arrays(f):
        with np.load(f, allow_pickle=False) as params:
            return {name: torch.from_numpy(params[name].copy()) for name in params.files}

    weights = _read(p, arrays)
    activation = "jumprelu" if "threshold" in weights else "relu"
    return _built(weights, Address.parse(reads), None if writes is None else Address.parse(writes), activation,
                  None, "none", False, dtype, p)


def _built(weights: dict, reads, writes, activation, k, normalize, apply_b_dec, dtype, p: Path) -> SAE:
    missing = [n for n in ("W_enc", "b_enc", "W_dec", "b_dec") if n not in weights]
    if missing:
        raise SpecError(fix(f"{p} lacks {', '.join(missing)} (it holds {', '.join(sorted(weights))}).",
                            "save the SAE with W_enc, b_enc, W_dec, b_dec (and threshold for jumprelu)."))
    cast = {}
    for name in TENSORS:
        if name in weights:
            t = weights[name] if dtype is None else weights[name].to(dtype)
            cast[name] = t if t.dtype in SPEC_DTYPES.values() else t.float()
    return SAE(**cast, reads=reads, writes=writes, activation=activation, k=k, normalize=normalize,
               apply_b_dec_to_input=apply_b_dec)
