"""Reading a harvest folder back: checked before it is returned, read lazily, each shard's digest checked at its
first open (or all at once with verify="upfront"). What is checked, and why sha256: interp_engine.harvest_store.

Cost, measured on a shared 2-core VM, page cache warm, 102,400 tokens x 3 points in bfloat16 (2 shards):
                               d=1024 (601 MiB)   d=4096 (2401 MiB)
  load_harvest (verify="lazy")       0.2 ms             0.2 ms       header + offsets per shard
  first read of shard 0            615 ms            1758 ms       its sha256, once per process
  later reads                        0.1 ms             0.1 ms
  load_harvest (verify="upfront")  805 ms            2481 ms       every shard's sha256 (a plain read: 720, 2120)
The structural checks grow with the shard count, not the data: 1,000 shards of 100 tokens load in 172 ms.
So "lazy" is the default: loading stays instant at any size, and nothing is read before it is checked. Its
price is that the first touch of a shard reads all of it (a random-access reader of a few rows pays a full
shard read once per process and shard); call `Harvest.verify()` before forking DataLoader workers and they
inherit the checked set instead of hashing again.
"""

import bisect
import itertools
import os
from pathlib import Path
from typing import Any

import torch

from interp_engine.errors import SpecError, fix
from interp_engine.harvest_store import MANIFEST, check_shard, read_manifest, verify_digest, warn_old

VERIFY = ("lazy", "upfront")


def load_harvest(out_dir: str | os.PathLike, *, partial: bool = False, verify: str = "lazy") -> "Harvest":
    """A harvest folder, read lazily. Refuses one still being written unless `partial=True` (then: its
    finished shards).

    The folder is checked before anything is returned (interp_engine.harvest_store): the manifest's schema and
    counts, and every shard's place (a plain file of this folder), size, tensors, shapes and offsets, at a
    header and the offsets per shard (~0.2 ms each). The sha256 of each shard's bytes is checked too:
    `verify="lazy"` (default) the first time the shard is opened in a process, so loading stays cheap and the
    data is checked just before it is first read (~1 s per GiB here, about what reading it costs);
    `verify="upfront"` hashes every shard now (measured costs: the module docstring). Anything that does not
    verify raises `HarvestError` with the fix.
    """
    if verify not in VERIFY:
        raise SpecError(fix(f"verify={verify!r} is not one of {VERIFY}.", 'use verify="lazy" (the default: each '
                            'shard hashed at first open) or verify="upfront" (all hashed now).'))
    out = Path(out_dir)
    manifest = read_manifest(out)
    if manifest is None:
        raise SpecError(fix(f"{out} holds no {MANIFEST}: it is not a harvest folder.",
                            "pass the out_dir given to harvest(...) or interp-engine harvest --out."))
    if not manifest["complete"] and not partial:
        raise SpecError(fix(f"the harvest in {out} is unfinished ({len(manifest['shards'])} shards, "
                            f"{manifest['n_prompts']} prompts so far).",
                            "rerun the same harvest(...) to finish it, or load_harvest(out, partial=True) to read "
                            "the finished shards."))
    for k in range(len(manifest["shards"])):
        check_shard(out, manifest, k)
    warn_old(out, manifest)
    harvest = Harvest(out, manifest)
    if verify == "upfront":
        harvest.verify()
    return harvest


def _verified(out: Path) -> "Harvest":
    """The harvest just written or resumed: its resumed shards were hashed, its new ones are this run's."""
    harvest = load_harvest(out)
    harvest._verified.update(range(harvest.n_shards))
    return harvest


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
        self._verified: set[int] = set()  # shards whose digest was checked (copied into DataLoader workers)

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

        if isinstance(k, bool) or not isinstance(k, int) or not -self.n_shards <= k < self.n_shards:
            raise IndexError(f"shard {k!r} is out of range: this harvest has {self.n_shards} shards")
        self._verify(k % self.n_shards)
        return load_file(self.folder / self.manifest["shards"][k]["file"])

    def verify(self) -> None:
        """Hash every shard not yet checked against the sha256 recorded when it was written (HarvestError if not)."""
        for k in range(self.n_shards):
            self._verify(k)

    def _verify(self, k: int) -> None:
        if k not in self._verified:
            verify_digest(self.folder, self.manifest, k)
            self._verified.add(k)

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
            self._verify(k)
            self._files[k] = safe_open(str(self.folder / self.manifest["shards"][k]["file"]), framework="pt")
        return self._files[k]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}

    def __repr__(self) -> str:
        return (f"Harvest({str(self.folder)!r}: {self.n_prompts} prompts, {self.n_tokens} tokens, "
                f"{self.n_shards} shards, points {list(self.points)})")
