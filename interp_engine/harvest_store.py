"""A harvest folder on disk: the manifest's schema, writing a shard, and checking a folder before trusting it.

Nothing in a folder is trusted: it may be damaged (a run killed mid-copy, a truncated file) or hostile (an
edited manifest). Before a harvest is read or resumed, every check below passes or a `HarvestError` says which:

- the manifest is UTF-8 JSON with every key of its format, each of the right type; its counts add up (each
  shard starts where the ones before it end; the shards' prompts and tokens sum to the totals);
- each shard is the plain file `shard-NNNNN.safetensors` in the folder itself (NNNNN its index), so a manifest
  cannot name `../x`, an absolute path or a symlink out of the folder;
- each shard's size is the one recorded, its header holds exactly "tokens", "offsets" and the points with the
  recorded dtypes and shapes (rows = the shard's tokens), its tensors tile the file, and its offsets rise from 0
  to its token count, one step per prompt (read from the file: a few bytes per prompt);
- its bytes hash to the sha256 recorded when it was written (`verify_digest`).

Why sha256 of the whole file: it covers the header as well as every tensor, it is computed once per shard
right after the file is written (from the page cache, in the background writer thread), and with SHA-NI it runs
at about 1.6 GB/s on one core, near disk speed, so it costs a read of the data and nothing more. The checks
above it cost a header and the offsets per shard: milliseconds per shard, whatever the activations' size.

Format 1 (before digests) is still read: everything but the digest is checked, and a warning says so.
"""

import hashlib
import json
import os
import re
import stat
import warnings
from pathlib import Path

import numpy as np

from interp_engine.errors import HarvestError, fix
from interp_engine.warnings import InterpEngineWarning

FORMAT = "interp_engine.harvest/2"
OLD_FORMAT = "interp_engine.harvest/1"  # no file digests, sizes or shapes
MANIFEST = "manifest.json"
TMP = ".tmp-"  # prefix of files being written; never listed in the manifest, removed on the next run
_MAX_MANIFEST = 256 << 20  # a manifest lists ~200 bytes per shard; anything this large is not one
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header
_CODES = {"float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
          "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1)}
_NAME = re.compile(r"shard-\d{5}\.safetensors")
# Keys of a manifest and of each shard entry, with their JSON types (int excludes bool, checked below).
_TOP = {"format": str, "model": dict, "points": list, "spec_fingerprint": str, "dtype": str, "shard_tokens": int,
        "chunk_prompts": int, "n_prompts": int, "n_tokens": int, "complete": bool, "shards": list}
_TOP_2 = {"shapes": dict}
_SHARD = {"file": str, "first_prompt": int, "prompts": int, "tokens": int, "token_digest": str}
_SHARD_2 = {"bytes": int, "sha256": str}
_REDO = ("rerun the same harvest(...) into this folder: a resume redoes every shard that does not verify (or "
         "harvest into a new folder).")
_EDITED = ("the manifest was edited or damaged, and a resume cannot repair it: harvest into a new folder (or "
           "restore the folder from a copy).")


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.safetensors"


# ---------------------------------------------------------------------------------------------- manifest
def read_manifest(out: Path) -> dict | None:
    """The folder's manifest, checked (schema and counts; not the shards); None when the folder has none."""
    path = out / MANIFEST
    if path.is_symlink():
        raise HarvestError(fix(f"{path} is a symbolic link: a harvest's manifest is a plain file in its folder.",
                               _EDITED))
    if not path.is_file():
        return None
    if path.stat().st_size > _MAX_MANIFEST:
        raise HarvestError(fix(f"{path} is {path.stat().st_size} bytes: too large to be a harvest manifest.",
                               _EDITED))
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise HarvestError(fix(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}): it is not a harvest "
                               "manifest.", _EDITED)) from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, 5000-digit ints, deep nesting
        raise HarvestError(fix(f"{path} is not valid JSON ({getattr(e, 'msg', None) or type(e).__name__}).",
                               _EDITED)) from None
    check_manifest(manifest, path)
    return manifest


def check_manifest(manifest, path: Path) -> None:
    if not isinstance(manifest, dict):
        raise HarvestError(fix(f"{path} holds a JSON {type(manifest).__name__}, not an object.", _EDITED))
    fmt = manifest.get("format")
    if fmt not in (FORMAT, OLD_FORMAT):
        raise HarvestError(fix(f"{path} has format {_repr(fmt)}; this interp_engine reads {FORMAT} and "
                               f"{OLD_FORMAT}.", "load it with the interp_engine that wrote it, or harvest again."))
    _keys(manifest, {**_TOP, **(_TOP_2 if fmt == FORMAT else {})}, str(path))
    points, dtype, shards = manifest["points"], manifest["dtype"], manifest["shards"]
    if not points or not all(isinstance(p, str) and p not in ("tokens", "offsets") for p in points) \
            or len(set(points)) != len(points):
        raise HarvestError(fix(f"{path}: points {_repr(points)} is not a list of distinct point names.", _EDITED))
    if dtype not in _CODES:
        raise HarvestError(fix(f"{path}: dtype {_repr(dtype)} is not one harvest stores ({', '.join(_CODES)}).",
                               _EDITED))
    for name in ("shard_tokens", "chunk_prompts"):
        if manifest[name] < 1:
            raise HarvestError(fix(f"{path}: {name} is {manifest[name]}, not a positive count.", _EDITED))
    if fmt == FORMAT and shards:
        shapes = manifest["shapes"]
        if sorted(shapes) != sorted(points) or not all(
                isinstance(s, list) and all(_is_int(d) and d >= 1 for d in s) for s in shapes.values()):
            raise HarvestError(fix(f"{path}: shapes {_repr(shapes)} does not give each point's row shape.", _EDITED))
    prompts = tokens = 0
    for k, shard in enumerate(shards):
        where = f"{path}: shard {k}"
        if not isinstance(shard, dict):
            raise HarvestError(fix(f"{where} is a JSON {type(shard).__name__}, not an object.", _EDITED))
        _keys(shard, {**_SHARD, **(_SHARD_2 if fmt == FORMAT else {})}, where)
        if shard["file"] != shard_name(k):  # also refuses "../x", "/etc/passwd" and any other folder
            raise HarvestError(fix(f"{where} names the file {_repr(shard['file'])}, not {shard_name(k)!r}: a "
                                   "harvest's shards are files of its own folder, numbered in order.", _EDITED))
        if shard["first_prompt"] != prompts:
            raise HarvestError(fix(f"{where} starts at prompt {shard['first_prompt']}, but the shards before it "
                                   f"hold {prompts} prompts.", _EDITED))
        if not 1 <= shard["prompts"] <= shard["tokens"]:  # every prompt has at least one token
            raise HarvestError(fix(f"{where} has {shard['prompts']} prompts and {shard['tokens']} tokens: each "
                                   "shard holds at least one prompt and each prompt at least one token.", _EDITED))
        prompts, tokens = prompts + shard["prompts"], tokens + shard["tokens"]
    if (manifest["n_prompts"], manifest["n_tokens"]) != (prompts, tokens):
        raise HarvestError(fix(f"{path} says {manifest['n_prompts']} prompts and {manifest['n_tokens']} tokens, but "
                               f"its shards hold {prompts} and {tokens}.", _EDITED))


def _keys(value: dict, schema: dict, where: str) -> None:
    missing = [k for k in schema if k not in value]
    if missing:
        raise HarvestError(fix(f"{where} lacks {', '.join(map(repr, missing))}.", _EDITED))
    for key, kind in schema.items():
        if not isinstance(value[key], kind) or (kind is int and not _is_int(value[key])) or \
                (kind is int and value[key] < 0):
            raise HarvestError(fix(f"{where}: {key} is {_repr(value[key])}, not a{'' if kind is int else ' JSON'} "
                                   f"{'non-negative int' if kind is int else kind.__name__}.", _EDITED))


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _repr(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------------- shards
def check_shard(out: Path, manifest: dict, k: int) -> None:
    """Shard `k` is a plain file of the folder whose size, header and offsets agree with the manifest."""
    shard = manifest["shards"][k]
    path = out / shard["file"]
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise HarvestError(fix(f"shard {k} ({path.name}) is missing from {out}.", _REDO)) from None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a plain file"
        raise HarvestError(fix(f"{path} is {kind}: a harvest's shards are plain files in its own folder.", _REDO))
    if manifest["format"] == FORMAT and info.st_size != shard["bytes"]:
        raise HarvestError(fix(f"{path} is {info.st_size} bytes, but it was {shard['bytes']} when written: it was "
                               "truncated or changed since.", _REDO))
    n_tokens, n_prompts = shard["tokens"], shard["prompts"]
    expected = {"tokens": ("I64", [n_tokens]), "offsets": ("I64", [n_prompts + 1])}
    code = _CODES[manifest["dtype"]][0]
    for point in manifest["points"]:
        rows = manifest["shapes"][point] if manifest["format"] == FORMAT else None
        expected[point] = (code, [n_tokens, *rows] if rows is not None else None)
    with path.open("rb") as f:
        header, start = _header(f, path, info.st_size)
        _check_tensors(header, expected, path, info.st_size - start)
        begin, end = header["offsets"]["data_offsets"]
        f.seek(start + begin)
        offsets = np.frombuffer(f.read(end - begin), dtype="<i8")
    if offsets[0] != 0 or offsets[-1] != n_tokens or (n_prompts and not (np.diff(offsets) > 0).all()):
        raise HarvestError(fix(f"{path}: its prompt offsets do not rise from 0 to its {n_tokens} tokens, one step "
                               "of at least one token per prompt.", _REDO))


def _header(f, path: Path, size: int) -> tuple[dict, int]:
    """The safetensors header (8-byte little-endian length, then JSON) and where the tensor bytes start."""
    raw = f.read(8)
    length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 2 <= length <= min(_MAX_HEADER, size - 8):
        raise HarvestError(fix(f"{path} is not a safetensors file (its header length is {length}, the file "
                               f"{size} bytes).", _REDO))
    try:
        header = json.loads(f.read(length).decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HarvestError(fix(f"{path} is not a safetensors file (its header is not JSON).", _REDO)) from None
    if not isinstance(header, dict):
        raise HarvestError(fix(f"{path} is not a safetensors file (its header is not an object).", _REDO))
    header.pop("__metadata__", None)
    return header, 8 + length


def _check_tensors(header: dict, expected: dict, path: Path, data_bytes: int) -> None:
    """Exactly the expected tensors, with their dtypes and shapes, tiling the data section with no gap."""
    if sorted(header) != sorted(expected):
        missing, extra = sorted(set(expected) - set(header)), sorted(set(header) - set(expected))
        raise HarvestError(fix(f"{path} holds tensors {sorted(header)}; the manifest says {sorted(expected)} "
                               f"(missing {missing}, unexpected {extra}).", _REDO))
    spans = []
    for name, (code, shape) in expected.items():
        entry = header[name]
        got = (entry.get("dtype"), entry.get("shape")) if isinstance(entry, dict) else (None, None)
        span = entry.get("data_offsets") if isinstance(entry, dict) else None
        if got[0] != code or not isinstance(got[1], list) or not all(_is_int(d) and d >= 0 for d in got[1]) or \
                (shape is not None and got[1] != shape) or (shape is None and got[1][:1] != expected["tokens"][1]):
            want = shape if shape is not None else f"[{expected['tokens'][1][0]}, ...]"
            raise HarvestError(fix(f"{path}: {name} is {got[0]} {got[1]}, the manifest says {code} {want}.", _REDO))
        width = {"I64": 8, **{c: w for c, w in _CODES.values()}}[code]
        if not (isinstance(span, list) and len(span) == 2 and all(_is_int(x) for x in span)
                and span[1] - span[0] == width * int(np.prod(got[1]))):
            raise HarvestError(fix(f"{path}: {name}'s byte span {_repr(span)} does not fit its shape.", _REDO))
        spans.append(span)
    spans.sort()
    if spans[0][0] != 0 or spans[-1][1] != data_bytes or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        raise HarvestError(fix(f"{path}: its tensors do not tile its {data_bytes} data bytes.", _REDO))


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_digest(out: Path, manifest: dict, k: int) -> None:
    """Shard `k`'s bytes hash to the sha256 recorded when it was written (format 1 recorded none)."""
    if manifest["format"] != FORMAT:
        return
    path = out / manifest["shards"][k]["file"]
    try:
        found = file_digest(path)
    except OSError as e:
        raise HarvestError(fix(f"cannot read {path}: {e.strerror or e}.", _REDO)) from None
    if found != manifest["shards"][k]["sha256"]:
        raise HarvestError(fix(f"{path} does not hash to the sha256 recorded when it was written: its bytes "
                               "changed since.", _REDO))


def warn_old(out: Path, manifest: dict) -> None:
    if manifest["format"] == OLD_FORMAT:
        warnings.warn(f"{out} was written in {OLD_FORMAT}, which records no shard digests: its shards' sizes, "
                      "shapes and counts were checked, their bytes were not. Harvest again for a verified copy.",
                      InterpEngineWarning, stacklevel=3)


# ---------------------------------------------------------------------------------------------- writing
def write_shard(out: Path, manifest: dict, shard: list, *, complete: bool) -> None:
    """Write one shard atomically (temp name, fsync, rename), then the manifest that lists it."""
    if shard:
        import torch
        from safetensors.torch import save_file

        ids = [p for chunk_ids, _ in shard for p in chunk_ids]
        lengths = torch.tensor([len(p) for p in ids], dtype=torch.int64)
        tensors = {"tokens": torch.tensor([t for p in ids for t in p], dtype=torch.int64),
                   "offsets": torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])}
        for key in manifest["points"]:
            tensors[key] = torch.cat([acts[key] for _, acts in shard]).contiguous()
            for _, acts in shard:  # the parts are copied: free them before the file's bytes are made
                acts.pop(key)
        manifest["shapes"] = manifest["shapes"] or {p: list(tensors[p].shape[1:]) for p in manifest["points"]}
        name = shard_name(len(manifest["shards"]))
        temp = out / f"{TMP}{name}"
        save_file(tensors, str(temp), metadata={"format": FORMAT})
        del tensors
        _fsync(temp)
        entry = {"file": name, "first_prompt": manifest["n_prompts"], "prompts": len(ids),
                 "tokens": int(lengths.sum()), "token_digest": token_digest(ids).hexdigest(),
                 "bytes": temp.stat().st_size, "sha256": file_digest(temp)}  # just written: read from page cache
        os.replace(temp, out / name)
        _fsync(out)
        manifest["shards"].append(entry)
        manifest["n_prompts"] += len(ids)
        manifest["n_tokens"] += entry["tokens"]
    manifest["complete"] = complete
    write_json(out / MANIFEST, manifest)


def token_digest(ids, h=None):
    from array import array

    h = h or hashlib.sha256()
    for row in ids:
        h.update(array("q", [len(row), *row]).tobytes())
    return h


def write_json(path: Path, value: dict) -> None:
    temp = path.with_name(f"{TMP}{path.name}")
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
