"""Harvesting activations to disk: sharded safetensors and a JSON manifest, resumable, memory bounded.

    OUT/manifest.json            what was harvested (model, points, spec fingerprint, dtype, sizes, library
                                 version, each point's row shape) and every finished shard: its first prompt,
                                 prompt and token counts, a digest of its token ids, its size and sha256
    OUT/shard-00000.safetensors  "tokens" [T] int64; "offsets" [P+1] int64 (prompt i is rows offsets[i] to
                                 offsets[i+1]); one [T, ...] tensor per point, named as str(address)

Each chunk of `chunk_prompts` prompts is prepared and checked as `capture` does it, then captured through the
runtime's `stream`, so a harvest runs on every backend that captures and each chunk's rows are what `capture`
returns for those prompts (unpadded). On vLLM the next chunk is queued before the last one finishes, so the
engine's batch stays full. Chunks are counted from the first prompt and a shard holds whole chunks, so an
interrupted run that resumes makes the same capture calls, and the same files, as one that never stopped.
"""

import contextlib
import functools
import hashlib
import itertools
import json
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import torch
from beartype import beartype
from jaxtyping import jaxtyped

from interp_engine.addresses import Address
from interp_engine.errors import HarvestError, InputTypeError, InterpEngineError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.harvest_ray import Replicas, check_replicas
from interp_engine.harvest_read import Harvest, _verified, load_harvest  # noqa: F401 (re-exported)
from interp_engine.harvest_saelens import arrow_default, saelens_problems, write_saelens
from interp_engine.harvest_store import (FORMAT, MANIFEST, TMP, check_shard, read_manifest, token_digest,
                                         verify_digest, write_json, write_shard)
from interp_engine.progress import bar as progress_bar
from interp_engine.spec import FLOAT_DTYPES, Op, Spec, as_spec
from interp_engine.warnings import InterpEngineWarning

__all__ = ["harvest", "Harvest", "load_harvest"]
_END = object()
# Settings a resumed run must share with the run that wrote the folder (anything else changes the files).
IDENTITY = ("format", "model", "points", "spec_fingerprint", "dtype", "shard_tokens", "chunk_prompts")


@jaxtyped(typechecker=beartype)
def harvest(model: ModelHandle, prompts: str | os.PathLike | Iterable, points: Sequence[str | Address] | str | Address,
            out_dir: str | os.PathLike, *, spec: Spec | Op | Sequence[Op] | None = None, shard_tokens: int = 65536,
            dtype: str | torch.dtype | None = None, chunk_prompts: int = 256, field: str = "text",
            progress: bool = True, replicas: int | None = None, format: str = "safetensors",
            context_size: int | None = None) -> Any:
    """Capture `points` on every prompt and stream them to sharded safetensors files in `out_dir`.

    `prompts`: a text file (one prompt per line; blank lines skipped), a .jsonl file (the string under
    `field` on each line), or an iterable of strings or token-id lists (read lazily). Each `capture` call
    takes `chunk_prompts` prompts (enough to fill vLLM's batch); a shard closes at the first chunk boundary
    at or past `shard_tokens` tokens. Activations are stored in `dtype` (default: the model's).
    Memory holds two shards (one being written in the background) and two chunks' rows (on vLLM the next chunk
    is in the engine while the last is stored), whatever the input size. A rerun into the same folder skips
    finished shards (after checking their prompts are the same and their files verify, digest included: one that
    does not is redone, with those after it) and resumes after them. Returns the harvest, read back lazily
    (`load_harvest`).

    `replicas=R` runs R engines as Ray actors (interp_engine.harvest_ray), each loading this model with the same
    load_model call, and writes the same folder; it joins the Ray cluster this process is connected to, or
    RAY_ADDRESS's, or starts a local one. Without it, this process's engine harvests.

    `format="saelens"` writes instead the `datasets` folder SAELens's cached-activations loader reads (one column
    per point under its TransformerLens hook name, rows of `context_size` tokens; see harvest_saelens.py) and
    returns it as a `datasets.Dataset`; it needs the `saelens` extra and is written whole (no resume).
    """
    for name, value in (("shard_tokens", shard_tokens), ("chunk_prompts", chunk_prompts)):
        if isinstance(value, bool) or value < 1:
            raise InputTypeError(fix(f"{name}={value!r} must be a positive int.", f"e.g. {name}=1024."))
    if replicas is not None:
        check_replicas(replicas)
    if format not in ("safetensors", "saelens"):
        raise InputTypeError(fix(f"format={format!r} is not a harvest format.",
                                 'use format="safetensors" (the default) or "saelens".'))
    if format == "safetensors" and context_size is not None:
        raise InputTypeError(fix("context_size applies only to format=\"saelens\" (safetensors rows are whole prompts).",
                                 'drop context_size, or pass format="saelens".'))
    if format == "saelens" and replicas is not None:
        raise InputTypeError(fix("replicas applies only to format=\"safetensors\" (a saelens folder is written whole).",
                                 'drop replicas, or harvest with format="safetensors".'))
    out = Path(out_dir)
    addresses = _check_points(model, points)
    store = _dtype(dtype, arrow_default(model.dtype) if format == "saelens" else model.dtype)
    spec = as_spec(spec)
    if format == "saelens":
        problems = saelens_problems(model, addresses, context_size, dtype, store)
        if problems:
            raise SpecError("\n".join(problems))
    source, count, described = _source(prompts, field)
    first = next(source, _END)
    if first is _END:
        raise SpecError(fix(f"{described} holds no prompts: there is nothing to harvest.",
                            "pass a file with one prompt per line, or a non-empty list of prompts."))
    source = itertools.chain([first], source)
    if format == "saelens":
        return write_saelens(model, source, addresses, out, context_size=context_size, spec=spec, store=store,
                             chunk_prompts=chunk_prompts, tokenize=_tokenizer(model), progress=progress)
    pool = None if replicas is None else Replicas.reserve(model, replicas)  # refuses what cannot be placed
    try:
        stream = model.runtime.stream if pool is None else functools.partial(
            pool.stream, points=addresses, spec=spec, store=store)
        return _write(model, out, source, count, described, addresses, spec, store, shard_tokens, chunk_prompts,
                      progress, stream)
    finally:
        if pool is not None:
            pool.release()


def _write(model: ModelHandle, out: Path, source: Iterator, count: int | None, described: str,
           addresses: tuple[Address, ...], spec: Spec, store: torch.dtype, shard_tokens: int, chunk_prompts: int,
           progress: bool, stream) -> "Harvest":
    identity = {
        "format": FORMAT,
        "model": {"name": model.name, "backend": model.backend, "dtype": str(model.dtype).removeprefix("torch."),
                  "n_layers": model.n_layers, "d_model": model.d_model, "d_vocab": model.d_vocab},
        "points": [str(a) for a in addresses], "spec_fingerprint": spec.fingerprint(),
        "dtype": str(store).removeprefix("torch."), "shard_tokens": shard_tokens, "chunk_prompts": chunk_prompts,
    }
    manifest = _open(out, identity)
    tokenize = _tokenizer(model)
    done_prompts = _skip_finished(source, manifest, tokenize, out)
    if manifest["complete"]:
        if next(source, None) is not None:
            raise SpecError(fix(f"{out} holds a finished harvest of {manifest['n_prompts']} prompts, and {described} "
                                "has more.", "harvest into a new folder (or delete this one to start over)."))
        return _verified(out)

    bar = progress_bar(desc=f"harvest {model.name}", unit="tok", unit_scale=True, progress=progress)
    bar.set_postfix_str(_progress(done_prompts, count))
    shard: list[tuple[tuple[tuple[int, ...], ...], dict[str, torch.Tensor]]] = []
    held = 0
    # Shards are written by one background thread while the next chunks are captured, so the engine is not
    # left idle during disk writes; at most one shard is in flight (memory stays bounded).
    chunks = _planned(model, source, chunk_prompts, addresses, spec, done_prompts)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp_engine-harvest") as writer, \
            contextlib.closing(stream(chunks, batch_size=32)) as captured:
        pending = None
        for prompts, rows in captured:
            ids = prompts.ids
            shard.append((ids, {str(a): rows.pop(a).to(store) for a in addresses}))
            n = sum(prompts.lengths)
            held, done_prompts = held + n, done_prompts + len(ids)
            bar.update(n)
            bar.set_postfix_str(_progress(done_prompts, count))
            if held >= shard_tokens:
                if pending is not None:
                    pending.result()
                pending = writer.submit(write_shard, out, manifest, shard, complete=False)
                shard, held = [], 0
        if pending is not None:
            pending.result()
    write_shard(out, manifest, shard, complete=True)
    bar.close()
    return _verified(out)


# ----------------------------------------------------------------------------------------------- checks
def _check_points(model: ModelHandle, points) -> tuple[Address, ...]:
    """Resolve and validate the points (and that the backend captures) before anything is read or written."""
    from interp_engine.func._prepare import prepare

    # A one-token prompt is enough to check points and backend; the spec is checked by each capture call.
    _, plan = prepare(model, [[0]], None, points, purpose="forward", verb="capture")
    patterns = [str(a) for a in plan.reads if a.info.pos_axis == 2]
    if patterns:
        raise SpecError(fix(f"harvest stores one row per token; {', '.join(patterns)} holds a [heads, q, k] pattern "
                            "per prompt.", "harvest q and k (softmax of q.k^T is the pattern), or use capture()."))
    if not plan.reads:
        raise SpecError(fix("harvest needs at least one point.", 'e.g. points=["resid_post.3"].'))
    return plan.reads


def _planned(model: ModelHandle, source: Iterator, size: int, addresses: tuple[Address, ...], spec: Spec,
             first: int):
    """Each chunk's prompts and plan, made as `capture` makes them (same checks), when the stream asks for it.
    A refusal names where in the input the chunk is (`capture` numbers prompts within the chunk)."""
    from interp_engine.func._prepare import prepare

    for chunk in _chunks(source, size):
        try:
            planned = prepare(model, chunk, spec, addresses, purpose="forward", verb="capture")
        except InterpEngineError as e:
            raise type(e)(f"harvest, prompts {first}..{first + len(chunk) - 1}: {e}") from None
        first += len(chunk)
        yield planned


def _dtype(value, default: torch.dtype) -> torch.dtype:
    if value is None:
        return default
    found = value if isinstance(value, torch.dtype) else FLOAT_DTYPES.get(str(value).removeprefix("torch."))
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise InputTypeError(fix(f"dtype={value!r} is not a floating-point torch dtype.",
                                 'use dtype="float32", "bfloat16" or "float16" (default: the model\'s).'))
    return found


def _tokenizer(model: ModelHandle):
    from interp_engine.inputs import to_prompts

    def tokenize(chunk: list) -> tuple[tuple[int, ...], ...]:
        return to_prompts(chunk, tokenize=model.tokenize, d_vocab=model.d_vocab, max_len=model.dims.max_len).ids
    return tokenize


def _progress(done: int, count: int | None) -> str:
    return f"{done}/{count} prompts" if count is not None else f"{done} prompts"


# ---------------------------------------------------------------------------------------------- prompts
def _source(prompts, field: str) -> tuple[Iterator, int | None, str]:
    """(an iterator of prompts, their count where known, how to name the input in messages)."""
    if isinstance(prompts, str | os.PathLike):
        path = Path(prompts)
        if not path.is_file():
            raise SpecError(fix(f"no prompt file at {path}.", "pass a text file (one prompt per line), a .jsonl file "
                                "(with field=...), or a list of prompts."))
        jsonl = path.suffix in (".jsonl", ".ndjson")
        # Read the file once up front so a bad line is refused before any forward pass (and the bar has a total).
        count = sum(1 for _ in _lines(path, jsonl, field))
        if count == 0:
            raise SpecError(fix(f"{path} holds no prompts.", "put one prompt per line (blank lines are skipped)."))
        return _lines(path, jsonl, field), count, str(path)
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        kind = type(prompts).__name__
        raise InputTypeError(fix(f"prompts must be a file path or an iterable of prompts, got {kind}.",
                                 'pass "prompts.txt", or a list of strings or of token-id lists.'))
    return iter(prompts), (len(prompts) if isinstance(prompts, Sized) else None), "the prompts"


def _lines(path: Path, jsonl: bool, field: str) -> Iterator:
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not jsonl:
                yield line.rstrip("\r\n")
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecError(fix(f"{path}:{number} is not JSON ({e.msg}).",
                                    "write one JSON object per line.")) from None
            value = record.get(field) if isinstance(record, dict) else None
            if not isinstance(value, str):
                has = f" (it has {', '.join(map(repr, record))})." if isinstance(record, dict) else "."
                raise SpecError(fix(f"{path}:{number} has no string field {field!r}{has}",
                                    f"give every line a {field!r} string, or name the field that holds the text "
                                    "(field=... / --field)."))
            yield value


def _chunks(source: Iterator, size: int) -> Iterator[list]:
    while chunk := list(itertools.islice(source, size)):
        yield chunk


def _skip_finished(source: Iterator, manifest: dict, tokenize, out: Path) -> int:
    """Consume the prompts of the finished shards, checking each shard's token digest; return their count.

    A shard whose file does not verify (missing, truncated, bytes changed: checked in full, digest included)
    is redone, with every shard after it: the manifest is cut back to the shards before it, so the run goes on
    from there and writes the same files a clean run would."""
    done = 0
    for i, shard in enumerate(manifest["shards"]):
        try:
            check_shard(out, manifest, i)
            verify_digest(out, manifest, i)
        except HarvestError as e:
            _cut(out, manifest, i, str(e).split("\n")[0])
            break
        h = hashlib.sha256()
        seen = 0
        for chunk in _chunks(itertools.islice(source, shard["prompts"]), manifest["chunk_prompts"]):
            token_digest(tokenize(chunk), h)
            seen += len(chunk)
        if seen != shard["prompts"] or h.hexdigest() != shard["token_digest"]:
            first, last = shard["first_prompt"], shard["first_prompt"] + shard["prompts"] - 1
            raise SpecError(fix(f"the prompts differ from those {out} was harvested from: shard {i} (prompts "
                                f"{first}..{last}) does not match.",
                                "pass the same prompts to resume, or harvest into a new folder."))
        done += seen
    return done


def _cut(out: Path, manifest: dict, k: int, why: str) -> None:
    warnings.warn(f"{why} Redoing shard {k} and the {len(manifest['shards']) - k - 1} after it.",
                  InterpEngineWarning, stacklevel=4)
    for shard in manifest["shards"][k:]:  # the run rewrites them: none may outlive the manifest that lists it
        (out / shard["file"]).unlink(missing_ok=True)
    del manifest["shards"][k:]
    manifest["n_prompts"] = sum(s["prompts"] for s in manifest["shards"])
    manifest["n_tokens"] = sum(s["tokens"] for s in manifest["shards"])
    manifest["complete"] = False
    write_json(out / MANIFEST, manifest)


# ---------------------------------------------------------------------------------------------- on disk
def _open(out: Path, identity: dict) -> dict:
    """The manifest to continue: a fresh one for an empty folder (or one whose manifest lists no finished shard),
    the existing one when its settings match; refused otherwise, naming every difference."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{TMP}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SpecError(fix(f"cannot write to {out}: {e.strerror or e}.",
                            "choose a folder you can write to.")) from None
    for stale in out.glob(f"{TMP}*"):  # a run killed while writing: never listed, never looks complete
        stale.unlink(missing_ok=True)
    existing = read_manifest(out)
    if existing is None:
        others = sorted(p.name for p in out.iterdir())
        if others:
            raise SpecError(fix(f"{out} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) "
                                f"and holds no harvest {MANIFEST}.", "harvest into a new or empty folder."))
    elif existing.get("shards"):
        if existing["format"] != FORMAT:
            raise SpecError(fix(f"{out} holds a harvest in {existing['format']}; this run writes {FORMAT}, which "
                                "adds shard digests, so it cannot resume it.",
                                "harvest into a new folder (load_harvest still reads this one)."))
        differ = [k for k in IDENTITY if existing.get(k) != identity[k]]
        if differ:
            lines = "; ".join(f"{k}: folder has {_short(existing.get(k))}, this run {_short(identity[k])}"
                              for k in differ)
            raise SpecError(fix(f"{out} holds a harvest made with other settings ({lines}).",
                                "rerun with the folder's settings to resume it, or harvest into a new folder."))
        return existing
    manifest = {**identity, "library_version": _version(), "n_prompts": 0, "n_tokens": 0, "complete": False,
                "shapes": {}, "shards": []}
    write_json(out / MANIFEST, manifest)
    return manifest


def _short(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _version() -> str:
    from interp_engine import __version__

    return __version__
