"""Harvesting activations to disk: sharded safetensors and a JSON manifest, resumable, memory bounded.

    OUT/manifest.json            what was harvested (model, points, spec fingerprint, dtype, sizes, library
                                 version) and every finished shard: its first prompt, prompt and token counts,
                                 and a digest of its token ids
    OUT/shard-00000.safetensors  "tokens" [T] int64; "offsets" [P+1] int64 (prompt i is rows offsets[i] to
                                 offsets[i+1]); one [T, ...] tensor per point, named as str(address)

Each chunk of `chunk_prompts` prompts is prepared and checked as `capture` does it, then captured through the
runtime's `stream`, so a harvest runs on every backend that captures and each chunk's rows are what `capture`
returns for those prompts (unpadded). On vLLM the next chunk is queued before the last one finishes, so the
engine's batch stays full. Chunks are counted from the first prompt and a shard holds whole chunks, so an
interrupted run that resumes makes the same capture calls, and the same files, as one that never stopped.
"""

import bisect
import contextlib
import hashlib
import itertools
import json
import os
from array import array
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any

import torch
from beartype import beartype
from jaxtyping import jaxtyped
from tqdm.auto import tqdm

from interp_engine.addresses import Address
from interp_engine.errors import InputTypeError, InterpEngineError, SpecError, fix
from interp_engine.handle import ModelHandle
from interp_engine.spec import FLOAT_DTYPES, Op, Spec, as_spec

FORMAT = "interp_engine.harvest/1"
MANIFEST = "manifest.json"
_END = object()
_TMP = ".tmp-"  # prefix of files being written; never listed in the manifest, removed on the next run
# Settings a resumed run must share with the run that wrote the folder (anything else changes the files).
IDENTITY = ("format", "model", "points", "spec_fingerprint", "dtype", "shard_tokens", "chunk_prompts")


@jaxtyped(typechecker=beartype)
def harvest(model: ModelHandle, prompts: str | os.PathLike | Iterable, points: Sequence[str | Address] | str | Address,
            out_dir: str | os.PathLike, *, spec: Spec | Op | Sequence[Op] | None = None, shard_tokens: int = 65536,
            dtype: str | torch.dtype | None = None, chunk_prompts: int = 256, field: str = "text",
            progress: bool = True) -> "Harvest":
    """Capture `points` on every prompt and stream them to sharded safetensors files in `out_dir`.

    `prompts`: a text file (one prompt per line; blank lines skipped), a .jsonl file (the string under
    `field` on each line), or an iterable of strings or token-id lists (read lazily). Each `capture` call
    takes `chunk_prompts` prompts (enough to fill vLLM's batch); a shard closes at the first chunk boundary
    at or past `shard_tokens` tokens. Activations are stored in `dtype` (default: the model's).
    Memory holds two shards (one being written in the background) and two chunks' rows (on vLLM the next chunk
    is in the engine while the last is stored), whatever the input size. A rerun into the same folder skips finished shards (after checking their prompts are the
    same) and resumes after them. Returns the harvest, read back lazily (`load_harvest`).
    """
    for name, value in (("shard_tokens", shard_tokens), ("chunk_prompts", chunk_prompts)):
        if isinstance(value, bool) or value < 1:
            raise InputTypeError(fix(f"{name}={value!r} must be a positive int.", f"e.g. {name}=1024."))
    out = Path(out_dir)
    addresses = _check_points(model, points)
    store = _dtype(dtype, model.dtype)
    spec = as_spec(spec)
    source, count, described = _source(prompts, field)
    first = next(source, _END)
    if first is _END:
        raise SpecError(fix(f"{described} holds no prompts: there is nothing to harvest.",
                            "pass a file with one prompt per line, or a non-empty list of prompts."))
    source = itertools.chain([first], source)
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
        return load_harvest(out)

    bar = tqdm(desc=f"harvest {model.name}", unit="tok", unit_scale=True, disable=not progress)
    bar.set_postfix_str(_progress(done_prompts, count))
    shard: list[tuple[tuple[tuple[int, ...], ...], dict[str, torch.Tensor]]] = []
    held = 0
    # Shards are written by one background thread while the next chunks are captured, so the engine is not
    # left idle during disk writes; at most one shard is in flight (memory stays bounded).
    chunks = _planned(model, source, chunk_prompts, addresses, spec, done_prompts)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="interp_engine-harvest") as writer, \
            contextlib.closing(model.runtime.stream(chunks, batch_size=32)) as captured:
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
                pending = writer.submit(_write_shard, out, manifest, shard, complete=False)
                shard, held = [], 0
        if pending is not None:
            pending.result()
    _write_shard(out, manifest, shard, complete=True)
    bar.close()
    return load_harvest(out)


def load_harvest(out_dir: str | os.PathLike, *, partial: bool = False) -> "Harvest":
    """A harvest folder, read lazily. Refuses one still being written unless `partial=True` (then: its
    finished shards)."""
    out = Path(out_dir)
    manifest = _read_manifest(out)
    if manifest is None:
        raise SpecError(fix(f"{out} holds no {MANIFEST}: it is not a harvest folder.",
                            "pass the out_dir given to harvest(...) or interp-engine harvest --out."))
    if not manifest["complete"] and not partial:
        raise SpecError(fix(f"the harvest in {out} is unfinished ({len(manifest['shards'])} shards, "
                            f"{manifest['n_prompts']} prompts so far).",
                            "rerun the same harvest(...) to finish it, or load_harvest(out, partial=True) to read "
                            "the finished shards."))
    return Harvest(out, manifest)


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


def _digest(ids: Iterable[Sequence[int]], h=None):
    h = h or hashlib.sha256()
    for row in ids:
        h.update(array("q", [len(row), *row]).tobytes())
    return h


def _skip_finished(source: Iterator, manifest: dict, tokenize, out: Path) -> int:
    """Consume the prompts of the finished shards, checking each shard's token digest; return their count."""
    done = 0
    for i, shard in enumerate(manifest["shards"]):
        h = hashlib.sha256()
        seen = 0
        for chunk in _chunks(itertools.islice(source, shard["prompts"]), manifest["chunk_prompts"]):
            _digest(tokenize(chunk), h)
            seen += len(chunk)
        if seen != shard["prompts"] or h.hexdigest() != shard["token_digest"]:
            first, last = shard["first_prompt"], shard["first_prompt"] + shard["prompts"] - 1
            raise SpecError(fix(f"the prompts differ from those {out} was harvested from: shard {i} (prompts "
                                f"{first}..{last}) does not match.",
                                "pass the same prompts to resume, or harvest into a new folder."))
        done += seen
    return done


# ---------------------------------------------------------------------------------------------- on disk
def _read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _open(out: Path, identity: dict) -> dict:
    """The manifest to continue: a fresh one for an empty folder (or one whose manifest lists no finished shard),
    the existing one when its settings match; refused otherwise, naming every difference."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f"{_TMP}probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise SpecError(fix(f"cannot write to {out}: {e.strerror or e}.",
                            "choose a folder you can write to.")) from None
    for stale in out.glob(f"{_TMP}*"):  # a run killed while writing: never listed, never looks complete
        stale.unlink(missing_ok=True)
    existing = _read_manifest(out)
    if existing is None:
        others = sorted(p.name for p in out.iterdir())
        if others:
            raise SpecError(fix(f"{out} is not empty ({', '.join(others[:3])}{', ...' if len(others) > 3 else ''}) "
                                f"and holds no harvest {MANIFEST}.", "harvest into a new or empty folder."))
    elif existing.get("shards"):
        differ = [k for k in IDENTITY if existing.get(k) != identity[k]]
        if differ:
            lines = "; ".join(f"{k}: folder has {_short(existing.get(k))}, this run {_short(identity[k])}"
                              for k in differ)
            raise SpecError(fix(f"{out} holds a harvest made with other settings ({lines}).",
                                "rerun with the folder's settings to resume it, or harvest into a new folder."))
        return existing
    manifest = {**identity, "library_version": _version(), "n_prompts": 0, "n_tokens": 0, "complete": False,
                "shards": []}
    _write_json(out / MANIFEST, manifest)
    return manifest


def _short(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _version() -> str:
    from interp_engine import __version__

    return __version__


def _write_shard(out: Path, manifest: dict, shard: list, *, complete: bool) -> None:
    """Write one shard atomically (temp name, fsync, rename), then the manifest that lists it."""
    if shard:
        from safetensors.torch import save_file

        ids = [p for chunk_ids, _ in shard for p in chunk_ids]
        lengths = torch.tensor([len(p) for p in ids], dtype=torch.int64)
        tensors = {"tokens": torch.tensor([t for p in ids for t in p], dtype=torch.int64),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])}
        for key in manifest["points"]:
            tensors[key] = torch.cat([acts[key] for _, acts in shard]).contiguous()
            for _, acts in shard:  # the parts are copied: free them before the file's bytes are made
                acts.pop(key)
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        temp = out / f"{_TMP}{name}"
        save_file(tensors, str(temp), metadata={"format": FORMAT})
        _fsync(temp)
        os.replace(temp, out / name)
        _fsync(out)
        manifest["shards"].append({"file": name, "first_prompt": manifest["n_prompts"], "prompts": len(ids),
                                   "tokens": int(lengths.sum()), "token_digest": _digest(ids).hexdigest()})
        manifest["n_prompts"] += len(ids)
        manifest["n_tokens"] += int(lengths.sum())
    manifest["complete"] = complete
    _write_json(out / MANIFEST, manifest)


def _write_json(path: Path, value: dict) -> None:
    temp = path.with_name(f"{_TMP}{path.name}")
    temp.write_text(json.dumps(value, indent=1))
    _fsync(temp)
    os.replace(temp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- reading
class Harvest(torch.utils.data.Dataset):
    """A harvest read lazily from its shards (memory-mapped; nothing is loaded until asked).

    As a Dataset it is one item per token: `harvest[i]` is `(token_id, {point: activation})`, so a plain
    `DataLoader(harvest, batch_size=4096, shuffle=True)` yields `(ids [B], {point: [B, ...]})` for SAE or
    probe training. `prompt(i)` gives one prompt's `(ids [n], {point: [n, ...]})`; `shard(k)` one whole shard.
    """

    def __init__(self, folder: Path, manifest: dict):
        self.folder, self.manifest = folder, manifest
        self.points: tuple[str, ...] = tuple(manifest["points"])
        self._token_ends = list(itertools.accumulate(s["tokens"] for s in manifest["shards"]))
        self._prompt_ends = list(itertools.accumulate(s["prompts"] for s in manifest["shards"]))
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()

    n_tokens = property(lambda self: self._token_ends[-1] if self._token_ends else 0)
    n_prompts = property(lambda self: self._prompt_ends[-1] if self._prompt_ends else 0)
    n_shards = property(lambda self: len(self.manifest["shards"]))

    def __len__(self) -> int:
        return self.n_tokens

    def __getitem__(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        k, j = self._locate(self._token_ends, i, "token")
        f = self._open(k)
        return f.get_slice("tokens")[j], {p: f.get_slice(p)[j] for p in self.points}

    def prompt(self, i: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        k, j = self._locate(self._prompt_ends, i, "prompt")
        f = self._open(k)
        start, stop = f.get_slice("offsets")[j:j + 2].tolist()
        return f.get_slice("tokens")[start:stop], {p: f.get_slice(p)[start:stop] for p in self.points}

    def shard(self, k: int) -> dict[str, torch.Tensor]:
        """Shard `k` whole: "tokens", "offsets" and one tensor per point (the fast path for a full pass)."""
        from safetensors.torch import load_file

        return load_file(self.folder / self.manifest["shards"][k]["file"])

    def _locate(self, ends: list[int], i: int, what: str) -> tuple[int, int]:
        total = ends[-1] if ends else 0
        if isinstance(i, bool) or not isinstance(i, int) or not -total <= i < total:
            raise IndexError(f"{what} {i!r} is out of range: this harvest holds {total} {what}s")
        i %= total
        k = bisect.bisect_right(ends, i)
        return k, i - (ends[k - 1] if k else 0)

    def _open(self, k: int):
        from safetensors import safe_open

        if self._pid != os.getpid():  # a DataLoader worker: open its own maps
            self._files, self._pid = {}, os.getpid()
        if k not in self._files:
            self._files[k] = safe_open(str(self.folder / self.manifest["shards"][k]["file"]), framework="pt")
        return self._files[k]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}

    def __repr__(self) -> str:
        return (f"Harvest({str(self.folder)!r}: {self.n_prompts} prompts, {self.n_tokens} tokens, "
                f"{self.n_shards} shards, points {list(self.points)})")
